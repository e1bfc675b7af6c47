"""Chat and text completions on top of the engine: prompts, tool calls, streaming, usage, capture.

Contract: `Service(engine, settings, drafter_note)` serves validated requests from `server.protocol`.
`chat(req, receive)` / `complete(req, receive)` return a response dict, or an async iterator of SSE
lines when `req.stream`; errors are `APIError`s. Every generation runs on the scheduler's single
worker thread (one request at a time, arrival order) and stops when the client disconnects.
`load_engine(settings)` builds the engine the CLI serves: model, index and drafter, logging what it
chose.

Prompting. Chat messages are rendered by `common.chat_format.ChatFormat`: the model's own chat template
when it mentions tools, otherwise Sailfish's built-in Gemma 4 format (plain text on any tokenizer,
so it also serves models with neither). Generated text is parsed back into OpenAI `tool_calls`.
tool_choice: "none" renders no tools and parses no calls; "auto" renders them; with the built-in
format "required" and a named function are ENFORCED by prefilling the model turn with
`<|tool_call>call:` (resp. `<|tool_call>call:NAME{`), so the first thing generated is that call;
with a chat template they are only requested by a system instruction (not enforced).
Sampling (server.sampling): every OpenAI/vLLM sampling field is honoured and sampled requests are
drafted too; for the same `seed` the output is the same with or without drafting. Fields a request
omits take the checkpoint's generation_config defaults (`--no-generation-defaults`: greedy).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

from common.progress import phase
from common.chat_format import CALL_OPEN, ChatFormat, ToolCallStreamParser
from server.engine import GenerationParams
from server.metrics import Metrics
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_chunk, chat_completion,
                             completion, error_body, new_call_id, new_id, usage_body)
from server.sampling import describe_defaults, sampling_defaults
from server.scheduler import Scheduler
from server.settings import Settings
from server.trace_log import TraceLog

log = logging.getLogger("sailfish.serving")
MAX_CHARS_PER_TOKEN = 64  # an upper bound on the characters one token spans (Gemma's longest are ~31)


# ---------------------------------------------------------------- loading

def load_engine(settings: Settings):
    """(engine, drafter note) for the CLI: load the target, the index, the drafter; log each choice."""
    from common.bundled_model import cache_root
    from common.paths import default_index_dir
    from common.tokenizer import tokenizer_fingerprint
    from ngram.drafter import NgramDrafter
    from ngram.index_file import IndexLoadError, load_index
    from server.engine import Engine
    from server.model_loading import load_target

    t0 = time.perf_counter()
    with phase(f"loading the model ({settings.model or 'the bundled Gemma 3 270M'})",
               "seconds; the bundled model is converted once first", say=log.info):
        target = load_target(settings.model, settings.quant, settings.dtype, settings.device)
    log.info("model %s: quant %s, dtype %s, device %s (loaded in %.1f s)", target.model_id, target.quant,
             str(target.dtype).removeprefix("torch."), target.device, time.perf_counter() - t0)
    for line in target.notes:
        log.info("  %s", line)

    drafter, note = None, "off (--no-draft): plain greedy decoding"
    if settings.draft:
        index_dir = Path(settings.index) if settings.index else default_index_dir()
        try:
            index = load_index(index_dir, tokenizer_fingerprint(target.tokenizer))
            drafter = NgramDrafter(index, settings.drafter)
            note = (f"index {index_dir}: {index.num_turns} turns, "
                    f"{len(index.trie)} n-gram keys, fingerprint {index.fingerprint[:12]}")
        except IndexLoadError as e:
            # No usable index: plain decoding, as documented; the reason is logged as a warning.
            note = f"no usable index ({e}): serving with plain decoding"
    (log.info if drafter is not None or not settings.draft else log.warning)("drafting: %s", note)

    t0 = time.perf_counter()
    # the cost curve is measured whenever drafting is on: an index may arrive later through a reload
    config = replace(settings.engine, max_draft=settings.drafter.max_draft,
                     adaptive=settings.engine.adaptive and settings.draft,
                     cost_cache=cache_root() / "cost-curves.json")
    with phase("preparing the engine", _engine_about(target.device, settings), say=log.info):
        engine = Engine(target, drafter, config)
    for line in engine.notes:
        log.info("engine: %s", line)
    cost = getattr(getattr(engine, "policy", None), "cost", None)
    if cost is not None and config.adaptive:
        curve = " ".join(f"{n}:{c:.2f}" for n, c in enumerate(cost) if n >= 1)
        log.info("verify cost curve (forward time for n new tokens / 1 token; engine ready in %.1f s): %s",
                 time.perf_counter() - t0, curve)
    log.info("context limit %d tokens", engine.max_context)
    defaults = sampling_defaults(engine.model.generation_config) if settings.generation_defaults else {}
    log.info("sampling defaults: %s%s; sampled requests are drafted too (same seed, same tokens)",
             describe_defaults(defaults), "" if settings.generation_defaults else " (--no-generation-defaults)")
    return engine, note


def _engine_about(device, settings: Settings) -> str:
    """How long `Engine(...)` usually takes, for the start-up line (the cost curve, when it has to be
    measured, says its own estimate)."""
    if str(device).startswith("cuda") and settings.engine.fast_path:
        return "CUDA graph capture: about 40 s on an H200"
    return "seconds"


# ---------------------------------------------------------------- the service

@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: GenerationParams
    forced: str            # text prefilled into the model turn (counts as generated, not as a token)
    offered: list[dict]    # tools the model saw
    parse_calls: bool


def _sse_errors(stream):
    """Wrap an SSE generator method: once streaming has begun the status is sent, so an error is
    reported as one last event in the OpenAI error shape (a generic message for unexpected ones)."""
    async def guarded(self, req, prep, rid, *args) -> AsyncIterator[str]:
        inner = stream(self, req, prep, rid, *args)
        try:
            async for line in inner:
                yield line
        except APIError as e:
            yield _sse(e.body())
        except Exception:
            log.exception("stream %s failed", rid)
            self.metrics.internal_error()
            yield _sse(error_body("internal error while generating", "server_error", None, "internal_error"))
        finally:
            await inner.aclose()  # a client that went away closes us: cancel the generation now
    return guarded


class Service:
    def __init__(self, engine, settings: Settings, drafter_note: str = ""):
        self.engine = engine
        self.settings = settings
        self.drafter_note = drafter_note
        self.chat_format = ChatFormat.for_tokenizer(engine.tokenizer)
        model = getattr(engine, "model", None)
        self.sampling_defaults = (sampling_defaults(getattr(model, "generation_config", None))
                                  if settings.generation_defaults else {})
        self.stop_token_ids = frozenset(self.chat_format.stop_token_ids(engine.tokenizer))
        self.scheduler = Scheduler()
        self.metrics = Metrics()
        self.trace_log = None
        if settings.trace_log:
            from common.paths import default_trace_dir

            self.trace_log = TraceLog(settings.trace_dir or default_trace_dir(),
                                      settings.trace_rotate_mb * 1024 * 1024)
        self.created = int(time.time())
        from server.reload import IndexReloader

        self.reloader = IndexReloader(engine, settings)

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    # ------------------------------------------------------------ chat

    def prepare_chat(self, req: ChatCompletionRequest) -> _Prepared:
        fmt, messages = self.chat_format, req.messages
        offered = req.tools if req.tool_choice != "none" else []
        forced = ""
        if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
            name = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
            if fmt.uses_template:
                ask = f"You must call the tool {name}." if name else "You must call one of the tools."
                messages = [{"role": "system", "content": ask}] + messages
            else:
                forced = f"{CALL_OPEN}call:{name}{{" if name else f"{CALL_OPEN}call:"
        text = fmt.render_prompt(messages, offered) + forced
        self._check_characters(len(text), "messages")
        prompt_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        self._check_context(len(prompt_ids), "messages", req.max_tokens)
        params = GenerationParams(max_tokens=max_tokens, stop_token_ids=self.stop_token_ids,
                                  stop_strings=tuple(fmt.stop_strings()) + req.stop, draft=True,
                                  sampling=req.sampling)
        return _Prepared(prompt_ids, params, forced, offered, parse_calls=bool(offered))

    async def chat(self, req: ChatCompletionRequest, receive=None) -> dict | AsyncIterator[str]:
        prep = self.prepare_chat(req)
        rid = new_id("chatcmpl")
        if req.stream:
            return self._chat_stream(req, prep, rid)
        run = _Run(self, "chat", prep, receive)
        content, calls = [], []
        parser = ToolCallStreamParser() if prep.parse_calls else None
        async for text in run.texts():
            c, k = parser.feed(text) if parser else (text, [])
            content.append(c)
            calls += k
        if parser:
            rest, more = parser.finish()
            content.append(rest)
            calls += more
        message = _assistant_message("".join(content), calls)
        finish = "tool_calls" if calls and run.finish == "stop" else run.finish
        self._capture(req, prep, message)
        return chat_completion(rid, self.model_id, message, finish, run.usage())

    @_sse_errors
    async def _chat_stream(self, req: ChatCompletionRequest, prep: _Prepared, rid: str) -> AsyncIterator[str]:
        created = int(time.time())
        chunk = lambda delta, finish=None: _sse(chat_chunk(rid, self.model_id, created, delta, finish,
                                                           None, req.include_usage))
        run = _Run(self, "chat", prep, None)
        parser = ToolCallStreamParser() if prep.parse_calls else None
        content, calls = [], []

        def deltas(c: str, k: list[dict]) -> list[str]:
            out = []
            if c:
                content.append(c)
                out.append(chunk({"content": c}))
            for call in k:
                call = _openai_call(call)
                i = len(calls)
                calls.append(call)
                out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                  "function": {"name": call["function"]["name"], "arguments": ""}}]}))
                arguments = call["function"]["arguments"]
                out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": arguments}}]}))
            return out

        yield chunk({"role": "assistant", "content": ""})
        async for text in run.texts():
            for line in deltas(*(parser.feed(text) if parser else (text, []))):
                yield line
        if parser:
            for line in deltas(*parser.finish()):
                yield line
        finish = "tool_calls" if calls and run.finish == "stop" else run.finish
        self._capture(req, prep, _assistant_message("".join(content), calls))
        yield chunk({}, finish)
        if req.include_usage:
            yield _sse(chat_chunk(rid, self.model_id, created, None, None, run.usage(), True))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ text completions

    async def complete(self, req: CompletionRequest, receive=None) -> dict | AsyncIterator[str]:
        tok = self.engine.tokenizer
        if isinstance(req.prompt, str):
            self._check_characters(len(req.prompt), "prompt")
        prompt_ids = list(req.prompt) if isinstance(req.prompt, list) else tok.encode(req.prompt)
        vocab = getattr(self.engine, "vocab_size", None)
        if isinstance(req.prompt, list) and vocab is not None and max(prompt_ids) >= vocab:
            raise APIError(400, f"token id {max(prompt_ids)} in 'prompt' is outside the vocabulary (0..{vocab - 1})",
                           "prompt", "invalid_value")
        self._check_context(len(prompt_ids), "prompt", req.max_tokens)
        params = GenerationParams(max_tokens=req.max_tokens, stop_token_ids=frozenset(), stop_strings=req.stop,
                                  draft=True, sampling=req.sampling)
        prep = _Prepared(prompt_ids, params, "", [], False)
        rid, created = new_id("cmpl"), int(time.time())
        if req.stream:
            return self._complete_stream(req, prep, rid, created)
        run = _Run(self, "completions", prep, receive)
        text = "".join([t async for t in run.texts()])
        return completion(rid, self.model_id, created, text, run.finish, run.usage())

    @_sse_errors
    async def _complete_stream(self, req, prep, rid, created) -> AsyncIterator[str]:
        run = _Run(self, "completions", prep, None)
        async for text in run.texts():
            if text:
                yield _sse(completion(rid, self.model_id, created, text, None, None, req.include_usage))
        yield _sse(completion(rid, self.model_id, created, "", run.finish, None, req.include_usage))
        if req.include_usage:
            yield _sse(completion(rid, self.model_id, created, None, None, run.usage(), True))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ helpers

    def _check_characters(self, n_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt whose characters alone prove it cannot fit: no token
        of the Gemma vocabulary spans more than MAX_CHARS_PER_TOKEN characters. (Tokenizing tens of
        megabytes only to refuse them would hold the engine's CPU for seconds.)"""
        limit = self.engine.max_context
        if n_chars > MAX_CHARS_PER_TOKEN * limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{n_chars} characters, more than {limit} tokens can hold. Shorten the {param}.",
                           param, "context_length_exceeded")

    def _check_context(self, n_prompt: int, param: str, max_tokens: int | None = None) -> None:
        """A prompt must leave room for one generated token; a max_tokens beyond the whole context can
        never be honoured (up to it, generation stops at the context's end with finish_reason length)."""
        limit = self.engine.max_context
        if n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{n_prompt} tokens. Shorten the {param}.", param, "context_length_exceeded")
        if max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"max_tokens is {max_tokens}, more than this model's context of {limit} tokens.",
                           "max_tokens", "invalid_value")

    def _capture(self, req: ChatCompletionRequest, prep: _Prepared, message: dict) -> None:
        if self.trace_log is None:
            return
        seen = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            seen["tool_calls"] = message["tool_calls"]
        self.trace_log.append(req.messages + [seen], prep.offered)

    def reload_index(self) -> tuple[bool, str]:
        changed, message = self.reloader.reload()
        if changed:
            self.drafter_note = message
        return changed, message

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_id, "drafting": self.drafter_note,
                "context_length": self.engine.max_context, "prefix_cache": self.engine.prefix_summary(),
                "waiting": self.scheduler.waiting, "running": self.scheduler.running}


class _Run:
    """One generation through the scheduler: text deltas out, usage and metrics at the end."""

    def __init__(self, service: Service, endpoint: str, prep: _Prepared, receive):
        self.service, self.endpoint, self.prep, self.receive = service, endpoint, prep, receive
        self.finish: str | None = None
        self.stats = None
        self.queue_s = 0.0

    async def texts(self) -> AsyncIterator[str]:
        svc, prep = self.service, self.prep
        if prep.forced:
            yield prep.forced
        t0 = time.perf_counter()
        ttft = None
        job = svc.scheduler.submit(lambda cancelled: svc.engine.generate(prep.prompt_ids, prep.params, cancelled))
        watcher = asyncio.ensure_future(_watch_disconnect(self.receive, job)) if self.receive else None
        outcome = "error"
        try:
            async for chunk in job:
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - t0
                self.stats = chunk.stats
                if chunk.finish_reason is not None:
                    self.finish = chunk.finish_reason
                if chunk.text:
                    yield chunk.text
            outcome = "ok" if self.finish is not None or not job.cancelled else "cancelled"
        except ValueError as e:  # the engine's refusal of a request (e.g. it does not fit the context)
            raise APIError(400, str(e), None, "invalid_request") from e
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            job.cancel()  # a no-op once finished; stops the engine when the client went away
            if watcher is not None:
                watcher.cancel()
            if job.started is not None:
                self.queue_s = job.started - job.submitted
            svc.metrics.record(self.endpoint, outcome, self.stats, time.perf_counter() - t0, ttft,
                               self.queue_s if job.started is not None else None)
        if outcome == "cancelled":  # a non-streaming client that went away: nobody reads the answer
            raise APIError(499, "the client disconnected", None, "client_disconnected")
        if self.finish is None:
            self.finish = "stop"

    def usage(self) -> dict:
        s = self.stats
        if s is None:
            return usage_body(len(self.prep.prompt_ids), 0, {})
        extra = {"cached_tokens": s.cached_tokens, "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
                 "drafts": s.drafts, "verify_steps": s.verify_steps, "plain_steps": s.plain_steps,
                 "acceptance_rate": round(s.accepted_tokens / s.drafted_tokens, 4) if s.drafted_tokens else None,
                 "decode_tokens_per_s": round(s.tokens_per_s, 2),
                 "prefill_s": round(s.prefill_s, 4), "decode_s": round(s.decode_s, 4),
                 "queue_s": round(self.queue_s, 4)}
        return usage_body(s.prompt_tokens, s.completion_tokens, extra, s.cached_tokens)


async def _watch_disconnect(receive, job) -> None:
    """Cancel the job when the client of a non-streaming request disconnects."""
    try:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                job.cancel()
                return
    except Exception:
        return


def _openai_call(call: dict) -> dict:
    if "function" in call:
        return call
    return {"id": new_call_id(), "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}


def _assistant_message(content: str, calls: list[dict]) -> dict:
    tool_calls = [_openai_call(c) for c in calls]
    message: dict[str, Any] = {"role": "assistant",
                               "content": content if (content.strip() or not tool_calls) else None,
                               "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
