"""The contenders of `make bench`, each run the same way: prompt ids in, a Run out.

Every contender decodes greedily on the same target and prompt. `decode_tok_s` is (tokens - 1) /
(time of the last token - time of the first): the first token is what the prefill yields, so the
prefill (identical work for every contender) is left out of every speed figure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from server.engine import Engine, GenerationParams


@dataclass
class Run:
    tokens: list[int]
    decode_s: float
    stats: dict = field(default_factory=dict)
    first_token_s: float = 0.0  # from the call to the first token (prefill), where measured

    @property
    def decode_tok_s(self) -> float:
        return max(len(self.tokens) - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0


def run_engine(engine: Engine, prompt: list[int], max_tokens: int, draft: bool, sampling=None,
               prefix_cache: bool = True) -> Run:
    tokens, stats = [], None
    params = GenerationParams(max_tokens=max_tokens, draft=draft, prefix_cache=prefix_cache)
    if sampling is not None:
        params.sampling = sampling
    for chunk in engine.generate(prompt, params):
        tokens += chunk.token_ids
        stats = chunk.stats
    s = stats
    return Run(tokens, s.decode_s, {"drafted": s.drafted_tokens, "accepted": s.accepted_tokens,
                                     "verify_steps": s.verify_steps, "plain_steps": s.plain_steps,
                                     "draft_s": s.draft_s, "forward_s": s.forward_s, "prefill_s": s.prefill_s})


class _Timestamps:
    """A transformers streamer that records when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.extend([time.perf_counter()] * value.numel())

    def end(self):
        pass


def run_hf_prompt_lookup(model, prompt: list[int], max_tokens: int, stop_ids: frozenset[int]) -> Run:
    streamer = _Timestamps()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             prompt_lookup_num_tokens=10, streamer=streamer, eos_token_id=sorted(stop_ids))
    new = out[0, len(prompt):].tolist()
    tokens = []
    for t in new:
        if t in stop_ids:
            break
        tokens.append(t)
    times = streamer.times
    return Run(tokens, (times[len(tokens) - 1] - times[0]) if len(tokens) > 1 else 0.0)


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the bundled GGUF, plain or with its prompt-lookup draft model."""

    def __init__(self, gguf_path: str, n_ctx: int = 8192, threads: int | None = None):
        import os

        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = threads or os.cpu_count()
        self.plain = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, verbose=False)
        self.lookup = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, verbose=False, logits_all=True,
                            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))

    def run(self, prompt: list[int], max_tokens: int, lookup: bool, stop_ids: frozenset[int]) -> Run:
        llm = self.lookup if lookup else self.plain
        llm.reset()
        tokens, times = [], []
        t0 = time.perf_counter()
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if token in stop_ids or len(tokens) >= max_tokens:
                break
            tokens.append(int(token))
        return Run(tokens, (times[len(tokens) - 1] - times[0]) if len(tokens) > 1 else 0.0,
                   first_token_s=times[0] - t0 if times else 0.0)


class LlamaServer:
    """A llama-server binary (llama.cpp's own server: its n-gram speculative modes, which
    llama-cpp-python lacks) on the bundled GGUF, one process per mode, queried with token-id prompts
    on /completion. `run` (bench.cpu_path): decode tokens/s is the server's own
    `predicted_per_second`, and prompts are never cached (`cache_prompt: false`), so every request
    prefills in full. `complete` (bench.concurrency): the prompt cache on, as the server has it by
    default."""

    # ngram-simple at n 4, m 16 (drafts of 16): its best setting in earlier measurements on this model
    MODES = {"plain": [], "ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                                            "--spec-ngram-simple-size-m", "16"],
             "ngram-mod": ["--spec-type", "ngram-mod"]}

    def __init__(self, binary: str, gguf_path: str, mode: str, threads: int, n_ctx: int = 8192, parallel: int = 1):
        """`parallel`: llama-server's slots (-np), requests decoded at once by its continuous
        batching; each slot gets a context of `n_ctx` tokens."""
        import subprocess

        from bench.live_server import free_port

        self.port = free_port()
        self.proc = subprocess.Popen([binary, "-m", gguf_path, "-t", str(threads), "-c", str(n_ctx * parallel),
                                      "-np", str(parallel), "--host", "127.0.0.1", "--port", str(self.port),
                                      *self.MODES[mode]],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        self.pause()

    def pause(self) -> None:
        """Stop the process while another contender is measured: an idle llama-server's threads still
        took about 17% of a core each, three of them half a core of this 2-core machine."""
        import signal

        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGCONT)

    def _wait_ready(self, timeout: float = 120.0) -> None:
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not become ready")

    def run(self, prompt: list[int], max_tokens: int) -> tuple[Run, float, float]:
        """(tokens, decode tokens/s, prefill tokens/s) for a greedy completion of `prompt`."""
        self.resume()
        try:
            out = self._completion({"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                                    "cache_prompt": False, "return_tokens": True})
        finally:
            self.pause()
        timings = out.get("timings", {})
        return (Run(list(out.get("tokens", [])), 0.0), float(timings.get("predicted_per_second", 0.0)),
                float(timings.get("prompt_per_second", 0.0)))

    def complete(self, prompt: list[int], max_tokens: int, stop: list[str]) -> tuple[str, int]:
        """(text, completion tokens) of a greedy completion of `prompt` that ends at a stop string or
        an end-of-generation token, its prompt cache on (a slot reuses the prefix it holds, as
        llama-server does by default). For concurrent requests: the server is not paused after it."""
        out = self._completion({"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                                "cache_prompt": True, "stop": stop})
        return out["content"], int(out.get("tokens_predicted", 0))

    def _completion(self, body: dict) -> dict:
        """POST /completion with `body`; its JSON answer."""
        import json
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.resume()  # a stopped process would not act on the terminate
        self.proc.terminate()
        self.proc.wait(timeout=30)
