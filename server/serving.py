"""Chat and text completions on top of the engine: prompts, tool calls, streaming, usage, capture.

Contract: `Service(engine, settings, drafter_note)` serves validated requests from `server.protocol`.
`chat(req, receive)` / `complete(req, receive)` return a response dict, or an async iterator of SSE
lines when `req.stream`; errors are `APIError`s. Either way the answer comes from the one generation
path, `Service._generate`: a stream of events (content deltas; `Reasoning` deltas of the model's
thinking; each tool call as a start once its name is complete, its arguments' JSON fragments as they
are generated, and an end; one `Finish` with finish_reason, the stop string that ended it, and usage)
that a streaming response formats
as chunks and a non-streaming one gathers whole. `await chat_events(req, receive, endpoint)` hands out
that event stream for another wire format (server.anthropic_api, the Messages API), and
`count_chat_tokens(req)` the length of the prompt a chat request renders to. A prompt is rendered and
tokenized (and the grammar compiler built, on the first constrained request) on a worker thread of
the event loop's pool, never on the loop itself: a long prompt or that first compile stalled every
other stream while it ran. Every generation runs on one of the scheduler's workers (as many as the
engine's lanes: requests at once, the rest waiting in arrival order) and stops when the client
disconnects or the server stops (a 503).
`load_engine(settings)` builds the engine the CLI serves: model, index and drafter, logging what it
chose.

Prompting. Chat messages are rendered by `common.chat_format.ChatFormat`: the model's own chat template
when it mentions tools, otherwise Sailfish's built-in Gemma 4 format (plain text on any tokenizer,
so it also serves models with neither). Gemma 4's thinking channel is split off the generated text
first, into `reasoning_content` (vLLM's field: `message.reasoning_content`, omitted when the model did
not think; streamed as `delta.reasoning_content`), never into `content`. The rest is parsed back into
OpenAI `tool_calls` as it is generated: a call starts (id, name) once its name is complete and its
arguments follow as JSON fragments whose concatenation is the answer's `arguments`. A call cut off
(max_tokens, or a body that breaks the syntax) stays a call in the stream and in the whole answer
alike, its arguments the unfinished JSON converted so far (not valid JSON, so no client can mistake it
for a finished call), with finish_reason "length" when max_tokens cut it.
tool_choice: "none" renders no tools and parses no calls; "auto" renders them; "required" and a named
function are enforced by a grammar (`_constraint`, where the format writes Gemma 4 calls and llguidance
reads the tokenizer; else by a forced call prefix, or only requested under another chat template, as
common.chat_format describes). A `strict` tool puts "auto" under a grammar too (free text, then calls
that follow the strict tools' schemas, or none), and `parallel_tool_calls: false` with a required,
named or strict call allows one call at most; where no grammar can run, those are refused.
Prompts are tokenized by `common.prompt_tokens.PromptTokens`: an agent's next turn resends its
conversation, and only the text after the last added token (a special token, a newline) that lies
well inside what it shares with a recent prompt is tokenized again (the ids are those of tokenizing
it whole; /metrics counts the tokens reused).
Sampling (server.sampling): every OpenAI/vLLM sampling field is honoured and sampled requests are
drafted too; for the same `seed` the output is the same with or without drafting. Fields a request
omits take the checkpoint's generation_config defaults (`--no-generation-defaults`: greedy).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator

from common.progress import phase
from common.prompt_tokens import PromptTokens
from common.chat_format import (CALL_CLOSE, CALL_OPEN, CONTENT, REASONING, ArgumentsDelta, CallEnded, CallStarted,
                                ChatFormat, ThinkingStreamParser, ToolCallStreamer)
from server.engine import GenerationParams
from server.grammar import GrammarError
from server.metrics import Metrics
from server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_chunk, chat_completion,
                             completion, error_body, new_call_id, new_id, usage_body)
from server.sampling import describe_defaults, sampling_defaults
from server.reload import IndexReloader, ReloadResult
from server.scheduler import QueueFull, Scheduler, ShuttingDown
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
    from server.tool_schema import make_drafter
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
            drafter = make_drafter(index, settings.drafter, target.tokenizer)
            note = (f"index {index_dir}: {index.num_turns} turns, "
                    f"{len(index.trie)} n-gram keys, fingerprint {index.fingerprint[:12]}")
        except IndexLoadError as e:
            # No usable index: the drafter still proposes from the live context (a prompt's own
            # repeats: the arguments an agent copies, a file it quotes back) and from this server's
            # own completions, which need no index; the reload watcher swaps in the index once one
            # is built. The reason is logged as a warning.
            drafter = make_drafter(None, settings.drafter, target.tokenizer)
            note = (f"no usable index ({e}): drafting from the live context and this server's own "
                    f"completions only, until an index is built (python -m index build)")
    (log.warning if settings.draft and getattr(drafter, "index", None) is None else log.info)("drafting: %s", note)

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
    offered: list[dict] = field(default_factory=list)  # tools the model saw; their calls are parsed back
    forced: str = ""  # the start of a tool call that ends the prompt (ChatFormat.forced_call)
    separate_reasoning: bool = False  # chat: the thinking channel becomes Reasoning events, not content


@dataclass
class Finish:
    reason: str  # the OpenAI finish_reason
    usage: dict
    stop_string: str | None = None  # the stop string (the format's end markers or the request's) that ended it


@dataclass(frozen=True)
class Reasoning:
    text: str  # a delta of the model's thinking (common.chat_format.ThinkingStreamParser), never empty


@dataclass
class ToolCallStart:
    """A tool call begins: its name is complete. `index` is its position among the answer's calls."""
    index: int
    id: str
    name: str


@dataclass
class ToolCallDelta:
    """The next fragment of call `index`'s arguments (JSON text, never empty)."""
    index: int
    arguments: str


@dataclass
class ToolCallEnd:
    """Call `index` is over. `call` is OpenAI-shaped (id, type, function name and arguments), its arguments
    exactly the concatenation of its ToolCallDelta fragments. `complete` False: generation ended (or the
    call's body broke the Gemma value syntax) before its object closed, so the arguments are an
    unfinished JSON text; the answer still carries the call, as its stream announced it (see
    common.chat_format.ToolCallStreamer)."""
    index: int
    call: dict
    complete: bool


# What a generation yields: content deltas (never empty); Reasoning deltas (chat only, never empty); per
# tool call a ToolCallStart as soon as its name is complete, ToolCallDelta fragments as its arguments are
# generated and a ToolCallEnd; one Finish last.
Event = str | Reasoning | ToolCallStart | ToolCallDelta | ToolCallEnd | Finish


class Service:
    def __init__(self, engine, settings: Settings, drafter_note: str = ""):
        self.engine = engine
        self.settings = settings
        self.drafter_note = drafter_note
        self.chat_format = ChatFormat.for_tokenizer(engine.tokenizer)
        # an agent's next turn resends its conversation: only its tail is tokenized again (the same
        # ids as tokenizing it whole)
        self.prompt_tokens = PromptTokens(engine.tokenizer)
        self._compiler = None  # server.grammar.GrammarCompiler, built on the first constrained request
        self._compiler_error: str | None = None
        self._compiler_lock = threading.Lock()   # requests are prepared on several threads: one build
        model = getattr(engine, "model", None)
        self.sampling_defaults = (sampling_defaults(getattr(model, "generation_config", None))
                                  if settings.generation_defaults else {})
        log.info("sampling defaults: %s%s; sampled requests are drafted too (same seed, same tokens)",
                 describe_defaults(self.sampling_defaults),
                 "" if settings.generation_defaults else " (--no-generation-defaults)")
        self.stop_token_ids = frozenset(self.chat_format.stop_token_ids(engine.tokenizer))
        self.scheduler = Scheduler(getattr(engine, "parallel", 1), settings.max_waiting)
        self.metrics = Metrics()
        self.trace_log = None
        if settings.trace_log:
            from common.paths import default_trace_dir

            self.trace_log = TraceLog(settings.trace_dir or default_trace_dir(),
                                      settings.trace_rotate_mb * 1024 * 1024)
        self.created = int(time.time())
        self.reloader = IndexReloader(engine, settings)

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    # ------------------------------------------------------------ chat

    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], list[dict], Any, str | dict]:
        """(prompt ids, the tools the model sees, the grammar constraint or None, the tool_choice the
        prompt is rendered with) of a chat request: one rendering for generation and for counting."""
        offered = req.tools if req.tool_choice != "none" else []
        constraint = self._constraint(req, offered)
        # An enforced call is the grammar's to write from its first token: no forced prefix then.
        tool_choice = "auto" if constraint is not None and offered else req.tool_choice
        text = self.chat_format.render_prompt(req.messages, offered, tool_choice)
        self._check_characters(len(text), "messages")
        return self.prompt_tokens.encode(text), offered, constraint, tool_choice

    def count_chat_tokens(self, req: ChatCompletionRequest) -> int:
        """The prompt tokens `req` renders to, as its generation's prompt (not checked against the
        context: a count, not a request)."""
        return len(self._chat_prompt(req)[0])

    def prepare_chat(self, req: ChatCompletionRequest) -> _Prepared:
        fmt = self.chat_format
        prompt_ids, offered, constraint, tool_choice = self._chat_prompt(req)
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        self._check_context(len(prompt_ids), "messages", req.max_tokens, req.max_tokens_field)
        forced = fmt.forced_call(tool_choice)
        # A call the request enforces (tool_choice required or named, strict tools: by a grammar, or by
        # a forced call start) is not cut by the request's stop strings: they end the text around it
        # (GenerationParams), since a cut call would break the enforcing field's promise. An
        # unenforced call is cut like text and answered as cut ("stop"; Messages: "stop_sequence").
        enforced = req.response_format is None and (constraint is not None or bool(forced))
        calls = (CALL_OPEN, CALL_CLOSE) if enforced and fmt.writes_gemma_calls else None
        params = GenerationParams(max_tokens=max_tokens, stop_token_ids=self.stop_token_ids,
                                  stop_strings=tuple(fmt.stop_strings()) + (() if calls else req.stop),
                                  text_stop_strings=req.stop if calls else (), call_markers=calls,
                                  in_call=bool(forced), draft=True, sampling=req.sampling, constraint=constraint)
        return _Prepared(prompt_ids, params, offered, forced, separate_reasoning=True)

    def _constraint(self, req: ChatCompletionRequest, offered: list[dict]):
        """The grammar the reply must follow (server.grammar), or None: a JSON response_format, or a
        required / named tool call in the Gemma 4 call syntax (the built-in format, or a chat template that
        writes it, as Gemma 4's does), or under tool_choice "auto" with a `strict` tool, free text then
        calls that follow their schemas, or none (the free text is text: no special token, so no
        thinking channel, before the calls). Under another chat template a tool call is requested by the
        template's instruction only, since its call syntax is the template's own;
        with a tokenizer llguidance cannot read, a call is enforced by its forced first tokens only
        (ChatFormat.forced_call) and a JSON format is refused."""
        enforced_call = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
        strict = req.strict_calls and req.tool_choice != "none" and req.response_format is None
        strict_auto = strict and req.tool_choice == "auto"
        one_call = enforced_call and not req.parallel_tool_calls and req.response_format is None
        # what only a grammar can honour (refused where none can run), and the field that asked for it
        wanted = ("response_format" if req.response_format is not None else "strict tools" if strict
                  else "one call at most (parallel_tool_calls: false)" if one_call else None)
        param = "response_format" if req.response_format is not None else "tools"
        if (strict or one_call) and not self.chat_format.writes_gemma_calls:
            raise APIError(400, f"{wanted} cannot be enforced under this model's chat template (its call syntax is "
                           "its own)", param, "unsupported_value")
        if req.response_format is None and not ((enforced_call or strict_auto) and self.chat_format.writes_gemma_calls):
            return None
        compiler = self._grammar_compiler()
        if compiler is None:
            if wanted is not None:
                raise APIError(400, f"{wanted} cannot be enforced: it needs constrained decoding, which this "
                               f"model's tokenizer does not support ({self._compiler_error})", param,
                               "unsupported_value")
            return None
        try:
            if req.response_format is None:
                named = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
                return compiler.tool_call(offered, named=named, parallel=req.parallel_tool_calls, optional=strict_auto)
            if req.response_format["type"] == "json_object":
                return compiler.json_object()
            return compiler.json_schema(req.response_format["schema"])
        except ValueError as e:
            raise APIError(400, f"cannot enforce this request's format: {e}", param, "invalid_value") from None

    def _grammar_compiler(self):
        """The tokenizer's grammar compiler, built on the first constrained request (a few seconds);
        None when llguidance cannot read the tokenizer (the reason is logged once)."""
        with self._compiler_lock:
            if self._compiler is None and self._compiler_error is None:
                from server.grammar import GrammarCompiler

                t0 = time.perf_counter()
                try:
                    vocab = getattr(self.engine, "vocab_size", None)
                    self._compiler = GrammarCompiler.for_tokenizer(self.engine.tokenizer, vocab_size=vocab)
                    log.info("grammar compiler for the tokenizer built in %.1f s", time.perf_counter() - t0)
                except Exception as e:  # llguidance refuses tokenizers it cannot read, in its own ways
                    self._compiler_error = f"{type(e).__name__}: {e}"[:300]
                    log.warning("constrained decoding unavailable: %s", self._compiler_error)
            return self._compiler

    async def chat_events(self, req: ChatCompletionRequest, receive=None,
                          endpoint: str = "chat") -> tuple[_Prepared, AsyncIterator[Event]]:
        """The prepared prompt (prepared off the event loop) and the events of the request's generation
        (a non-streaming request watches `receive` for a disconnect); `endpoint` labels its metrics."""
        prep = await asyncio.to_thread(self.prepare_chat, req)
        return prep, self._generate(endpoint, prep, None if req.stream else receive, capture=req)

    async def chat(self, req: ChatCompletionRequest, receive=None) -> dict | AsyncIterator[str]:
        _, events = await self.chat_events(req, receive)
        rid = new_id("chatcmpl")
        if req.stream:
            return self._sse(rid, self._chat_chunks(req, rid, events))
        content, calls, end, reasoning = await _collect(events)
        return chat_completion(rid, self.model_id, _assistant_message(content, calls, reasoning), end.reason,
                               end.usage)

    async def _chat_chunks(self, req: ChatCompletionRequest, rid: str, events) -> AsyncIterator[dict]:
        """The role, one chunk per content delta and per reasoning delta (`reasoning_content`), per tool
        call a start chunk (index, id, name, empty arguments) then one chunk per arguments fragment as it
        is generated, the finish_reason, and with include_usage a last chunk with the usage only."""
        created = int(time.time())
        chunk = lambda delta, finish=None: chat_chunk(rid, self.model_id, created, delta, finish, None,
                                                      req.include_usage)
        yield chunk({"role": "assistant", "content": ""})
        async for event in events:
            if isinstance(event, str):
                yield chunk({"content": event})
            elif isinstance(event, Reasoning):
                yield chunk({"reasoning_content": event.text})
            elif isinstance(event, ToolCallStart):
                yield chunk({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                             "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ToolCallDelta):
                yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
            elif isinstance(event, Finish):
                yield chunk({}, event.reason)
                if req.include_usage:
                    yield chat_chunk(rid, self.model_id, created, None, None, event.usage, True)

    # ------------------------------------------------------------ text completions

    async def complete(self, req: CompletionRequest, receive=None) -> dict | AsyncIterator[str]:
        tok = self.engine.tokenizer
        if isinstance(req.prompt, str):
            self._check_characters(len(req.prompt), "prompt")
        prompt_ids = list(req.prompt) if isinstance(req.prompt, list) else await asyncio.to_thread(tok.encode, req.prompt)
        vocab = getattr(self.engine, "vocab_size", None)
        if isinstance(req.prompt, list) and vocab is not None and max(prompt_ids) >= vocab:
            raise APIError(400, f"token id {max(prompt_ids)} in 'prompt' is outside the vocabulary (0..{vocab - 1})",
                           "prompt", "invalid_value")
        self._check_context(len(prompt_ids), "prompt", req.max_tokens, req.max_tokens_field)
        params = GenerationParams(max_tokens=req.max_tokens, stop_token_ids=frozenset(), stop_strings=req.stop,
                                  draft=True, sampling=req.sampling)
        rid, created = new_id("cmpl"), int(time.time())
        events = self._generate("completions", _Prepared(prompt_ids, params), None if req.stream else receive)
        if req.stream:
            return self._sse(rid, self._completion_chunks(req, rid, created, events))
        text, _, end, _ = await _collect(events)
        return completion(rid, self.model_id, created, text, end.reason, end.usage)

    async def _completion_chunks(self, req: CompletionRequest, rid: str, created: int, events) -> AsyncIterator[dict]:
        """One chunk per text delta, the finish_reason, and with include_usage a last chunk with the usage only."""
        async for event in events:
            if isinstance(event, Finish):
                yield completion(rid, self.model_id, created, "", event.reason, None, req.include_usage)
                if req.include_usage:
                    yield completion(rid, self.model_id, created, None, None, event.usage, True)
            else:
                yield completion(rid, self.model_id, created, event, None, None, req.include_usage)

    # ------------------------------------------------------------ the one generation path

    def _generate(self, endpoint: str, prep: _Prepared, receive,
                  capture: ChatCompletionRequest | None = None) -> AsyncIterator[Event]:
        """The request's generation, queued now: a 429 with Retry-After (an APIError, before any
        stream begins) when the scheduler's queue is full; else its events (`_events`)."""
        try:
            job = self.scheduler.submit(lambda cancelled: self.engine.generate(prep.prompt_ids, prep.params, cancelled))
        except QueueFull as e:
            self.metrics.record(endpoint, "rejected")
            raise APIError(429, f"the server is busy: {e}; retry later", None, "rate_limit_exceeded",
                           type="rate_limit_error", headers={"Retry-After": str(self.scheduler.retry_after())}) from e
        except ShuttingDown as e:
            self.metrics.record(endpoint, "rejected")
            raise _shutting_down() from e
        return self._events(endpoint, prep, receive, capture, job)

    async def _events(self, endpoint: str, prep: _Prepared, receive, capture: ChatCompletionRequest | None,
                      job) -> AsyncIterator[Event]:
        """One generation through the scheduler as `Event`s, for both endpoints, streamed or not; its
        metrics are recorded. With `prep.separate_reasoning` the thinking channel is split off first, as
        Reasoning events (the tool-call parser sees content only). When the model saw tools, their calls
        are parsed out of the content as they are generated (common.chat_format.ToolCallStreamer) and a
        finish_reason "stop" after calls that all finished is "tool_calls" (one a stop string cut off
        leaves it "stop", with that stop string). With `capture`, the chat request and its answer
        (content and complete calls only) are appended to the trace log. `receive` (non-streaming only)
        watches for a disconnect."""
        parser = ToolCallStreamer(prep.forced) if prep.offered else None
        thinking = ThinkingStreamParser() if prep.separate_reasoning else None
        content, calls, finish, stats, ttft, t0 = [], [], None, None, None, time.perf_counter()
        stop_string, captured_calls, open_call_id = None, [], ""
        in_call, held_reasoning = False, []  # thinking generated inside a call waits for the call's end
        cut_call = False  # a call ended unfinished (a stop string, max_tokens or broken syntax cut it)

        def events(parsed: list) -> list[Event]:
            nonlocal open_call_id, in_call, cut_call
            out: list[Event] = []
            for item in parsed:
                if isinstance(item, str):
                    content.append(item)
                    out.append(item)
                elif isinstance(item, CallStarted):
                    open_call_id, in_call = new_call_id(), True
                    out.append(ToolCallStart(len(calls), open_call_id, item.name))
                elif isinstance(item, ArgumentsDelta):
                    out.append(ToolCallDelta(len(calls), item.text))
                elif isinstance(item, CallEnded):
                    call = _openai_call(open_call_id, item.name, item.arguments)
                    out.append(ToolCallEnd(len(calls), call, item.complete))
                    calls.append(call)
                    if item.complete:
                        captured_calls.append(call)
                    else:
                        cut_call = True
                    in_call = False
                    out += [Reasoning(text) for text in held_reasoning]
                    held_reasoning.clear()
            return out

        def routed(segments: list[tuple[str, str]]) -> list[Event]:
            """Thinking segments as Reasoning events, content segments through the tool-call parser. Thinking
            inside a call's body (the model's markup, split off before the call parser sees it) follows the
            call's ToolCallEnd, so no event interrupts a call."""
            out: list[Event] = []
            for kind, text in segments:
                if kind == REASONING:
                    if in_call:
                        held_reasoning.append(text)
                    else:
                        out.append(Reasoning(text))
                else:
                    out += events(parser.feed(text) if parser else [text])
            return out

        watcher = asyncio.ensure_future(_watch_disconnect(receive, job)) if receive else None
        outcome = "error"
        try:
            async for chunk in job:
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - t0
                stats, finish = chunk.stats, chunk.finish_reason or finish
                stop_string = chunk.stop_string or stop_string
                if chunk.text:
                    for event in routed(thinking.feed(chunk.text) if thinking else [(CONTENT, chunk.text)]):
                        yield event
            outcome = "ok" if finish is not None or not job.cancelled else "cancelled"
        except ValueError as e:  # the engine's refusal of a request (e.g. it does not fit the context)
            raise APIError(400, str(e), None, "invalid_request") from e
        except GrammarError as e:  # a format the checks passed that llguidance cannot continue: the request's
            log.warning("constrained generation stopped: %s", e)
            raise APIError(400, f"the requested format cannot be followed here: {e}", "response_format"
                           if prep.params.constraint is not None and prep.params.constraint.kind == "json_schema"
                           else "tools", "invalid_value") from e
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            job.cancel()  # a no-op once finished; stops the engine when the client went away
            if watcher is not None:
                watcher.cancel()
            queue_s = job.started - job.submitted if job.started is not None else None
            self.metrics.record(endpoint, outcome, stats, time.perf_counter() - t0, ttft, queue_s)
        if outcome == "cancelled" and self.scheduler.stopping:  # Ctrl-C / SIGTERM while it ran
            raise _shutting_down()
        if outcome == "cancelled":  # a non-streaming client that went away: nobody reads the answer
            raise APIError(499, "the client disconnected", None, "client_disconnected")
        for event in routed(thinking.finish()) if thinking else []:
            yield event
        for event in events(parser.finish()) if parser else []:
            yield event
        if capture is not None:
            self._capture(capture, prep, _assistant_message("".join(content), captured_calls))
        finish = finish or "stop"
        # "tool_calls" only for calls that all finished: a stop string that cut one ends it as "stop"
        yield Finish("tool_calls" if calls and finish == "stop" and not cut_call else finish,
                     _usage(prep, stats, queue_s or 0.0), stop_string)

    async def _sse(self, rid: str, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """`chunks` as SSE lines, then [DONE]. Once streaming has begun the status is sent, so an error is
        reported as one last event in the OpenAI error shape (a generic message for unexpected ones)."""
        try:
            async for chunk in chunks:
                yield _sse_line(chunk)
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _sse_line(e.body())
        except Exception:
            log.exception("stream %s failed", rid)
            self.metrics.internal_error()
            yield _sse_line(error_body("internal error while generating", "server_error", None, "internal_error"))
        finally:
            await chunks.aclose()  # a client that went away closes us: cancel the generation now

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

    def _check_context(self, n_prompt: int, param: str, max_tokens: int | None = None,
                       max_tokens_field: str = "max_tokens") -> None:
        """A prompt must leave room for one generated token; a max_tokens beyond the whole context can
        never be honoured (up to it, generation stops at the context's end with finish_reason length).
        The 400 names the limit as the request did (`max_tokens_field`)."""
        limit = self.engine.max_context
        if n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{n_prompt} tokens. Shorten the {param}.", param, "context_length_exceeded")
        if max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"{max_tokens_field} is {max_tokens}, more than this model's context of {limit} "
                                "tokens.", max_tokens_field, "invalid_value")

    def _capture(self, req: ChatCompletionRequest, prep: _Prepared, message: dict) -> None:
        if self.trace_log is None:
            return
        seen = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            seen["tool_calls"] = message["tool_calls"]
        self.trace_log.append(req.messages + [seen], prep.offered)

    def reload_index(self) -> ReloadResult:
        return self.reloader.reload()

    def health(self) -> dict:
        index = self.reloader.in_service()
        # what the latest reload put in service (by a request, SIGHUP or the watcher), else the start's
        return {"status": "ok", "model": self.model_id, "drafting": self.reloader.note or self.drafter_note,
                "index": None if index is None else str(index),
                "context_length": self.engine.max_context, "prefix_cache": self.engine.prefix_summary(),
                "waiting": self.scheduler.waiting, "running": self.scheduler.running,
                "parallel": self.scheduler.workers, "batching": self.engine.batch_summary()}


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down: the generation was stopped or not started", None,
                    "server_shutting_down", type="server_error")


def _usage(prep: _Prepared, stats, queue_s: float) -> dict:
    """OpenAI's usage, plus what drafting did and where the time went under `sailfish`."""
    if stats is None:
        return usage_body(len(prep.prompt_ids), 0, {})
    drafted, accepted = stats.drafted_tokens, stats.accepted_tokens
    extra = {"cached_tokens": stats.cached_tokens, "drafted_tokens": drafted, "accepted_tokens": accepted,
             "drafts": stats.drafts, "verify_steps": stats.verify_steps, "plain_steps": stats.plain_steps,
             "chained_steps": stats.chained_steps, "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
             "decode_tokens_per_s": round(stats.tokens_per_s, 2),
             "prefill_s": round(stats.prefill_s, 4), "decode_s": round(stats.decode_s, 4), "queue_s": round(queue_s, 4)}
    return usage_body(stats.prompt_tokens, stats.completion_tokens, extra, stats.cached_tokens)


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


async def _collect(events: AsyncIterator[Event]) -> tuple[str, list[dict], Finish, str]:
    """A non-streaming answer: the events of its generation gathered into (content, tool calls, Finish,
    reasoning)."""
    gathered = [event async for event in events]
    content = "".join(event for event in gathered if isinstance(event, str))
    reasoning = "".join(event.text for event in gathered if isinstance(event, Reasoning))
    calls = [event.call for event in gathered if isinstance(event, ToolCallEnd)]
    return content, calls, gathered[-1], reasoning


def _openai_call(call_id: str, name: str, arguments: str) -> dict:
    """A parsed call in the OpenAI shape."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant_message(content: str, tool_calls: list[dict], reasoning: str = "") -> dict:
    """The chat message of an answer; `reasoning_content` only when the model thought."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": content if (content.strip() or not tool_calls) else None,
                               "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _sse_line(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
