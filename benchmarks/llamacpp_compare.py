"""tandem's CPU engine against llama.cpp on the same weights (SmolLM2-135M-Instruct), same
threads, engines alternated over `--rounds` rounds, each round's ratio tandem / llama.cpp.

Sections (`--only`, comma-separated):
- decode:     batch-1 greedy decode, bf16, `--tokens` tokens (EOS ignored). llama.cpp:
              `llama-bench -p 0 -n TOKENS` (its tg figure); tandem: `engine.llm.LLM` in this
              process, the time per output token after the first (`RequestOutput.tpot`);
- prefill:    one `--prompt-tokens` prompt, bf16. llama.cpp: `llama-bench -p N -n 0` (pp);
              tandem: the wall time of `generate(max_tokens=1)` on a fresh random prompt
              (prefix caching off, so no round reads another's blocks);
- concurrent: `--concurrency` requests at once, random token-id prompts of `--serve-input`
              tokens, `--serve-output` tokens each (ignore_eos), output tokens/s, with tandem's
              own streaming client (bench.client, /v1/completions) against `llama-server -np N
              -cb` (continuous batching, a context of N slots) and `tandem serve --mode
              colocated --replicas 1` (one engine on both cores: the cheapest topology of
              tandem's CPU serving; the router, Ray and HTTP are all in the path);
- int8:       batch-1 decode, tandem `quantization="int8"` against llama.cpp Q8_0.
- w8a8:       the same with tandem `quantization="int8-w8a8"` (decode activations int8 per
              block of 32: Q8_0's own arithmetic).
Before the rounds, greedy agreement: llama-server's tokens (`/completion`, top_k 1) against
tandem's for `--agree-prompts` chat prompts, bf16 (and Q8_0 vs int8 with `int8`).

llama.cpp is built from the llama-cpp-python sdist into ~/.cache/tandem/llamacpp/<version>/
on first use (benchmarks/llamacpp_build.py; `--skip-build` refuses to build). The weights:
the GGUF file `tandem fetch-model` fetched, read by tandem's loader, saved as bf16
safetensors (what tandem loads), converted to GGUF bf16 and Q8_0 by llama.cpp's own tools.

Usage: `python benchmarks/llamacpp_compare.py [--rounds 3] [--tokens 128] [--only decode,...]
[--skip-build] [--sdist PATH] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import log, machine_info, set_threads, write_json  # noqa: E402
from benchmarks.llamacpp_build import (  # noqa: E402
    VERSION,
    BuildError,
    Layout,
    Weights,
    build,
    cache_dir,
    ensure_sdist,
    prepare_weights,
    source_commit,
)
from benchmarks.llamacpp_report import (  # noqa: E402
    SECTIONS,
    agreement,
    format_table,
    parse_llama_bench,
    plot,
    round_line,
    summarize_section,
)

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works, in simple terms.",
    "Give me three tips for learning a new language.",
)


# --------------------------------------------------------------------------- llama.cpp


def llama_bench(layout: Layout, model: Path, threads: int, n_prompt: int, n_gen: int) -> dict:
    """One llama-bench test (pp or tg), one repetition after its own warm-up run."""
    cmd = [str(layout.binary("llama-bench")), "-m", str(model), "-t", str(threads)]
    cmd += ["-p", str(n_prompt), "-n", str(n_gen), "-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = parse_llama_bench(proc.stdout)
    if len(rows) != 1:
        raise BuildError(f"llama-bench gave {len(rows)} results, expected 1")
    return rows[0]


class LlamaServer:
    """`llama-server` on a free port for the duration of a `with` block."""

    def __init__(self, layout: Layout, model: Path, threads: int, slots: int, ctx: int):
        self.cmd = [str(layout.binary("llama-server")), "-m", str(model), "-t", str(threads)]
        self.cmd += ["-tb", str(threads), "-np", str(slots), "-c", str(ctx), "-cb"]
        self.cmd += ["--host", "127.0.0.1", "--port", str(_free_port()), "--no-webui"]
        self.url = f"http://127.0.0.1:{self.cmd[self.cmd.index('--port') + 1]}"
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                self.log.seek(0)
                raise BuildError(f"llama-server did not start:\n{self.log.read()[-3000:]}")
            time.sleep(0.3)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _complete(self, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + "/completion",
            data=json.dumps(body | {"cache_prompt": False, "temperature": 0.0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def greedy(self, ids: list[int], n: int) -> list[int]:
        body = {"prompt": ids, "n_predict": n, "top_k": 1, "ignore_eos": True}
        return list(self._complete(body | {"return_tokens": True})["tokens"])

    def top2(self, ids: list[int]) -> list[tuple[int, float]]:
        """llama.cpp's two likeliest next tokens after `ids`, with their logprobs."""
        body = {"prompt": ids, "n_predict": 1, "n_probs": 2, "ignore_eos": True}
        probs = self._complete(body)["completion_probabilities"][0]["top_logprobs"]
        return [(p["id"], p["logprob"]) for p in probs]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- tandem


def tandem_llm(weights: Weights, quantization: str | None = None):
    from engine.llm import LLM

    settings = {"dtype": "bfloat16", "num_kv_blocks": 256, "enable_prefix_caching": False}
    if quantization:
        settings["quantization"] = quantization
    return LLM(str(weights.hf_dir), **settings)


def tandem_decode(llm, ids: list[int], tokens: int, mask_eos: bool = False):
    """Batch-1 greedy decode tokens/s (after the first token) and the tokens. `mask_eos`:
    EOS can never be sampled (`min_tokens`), which is what llama-server's `ignore_eos` does
    (it biases end-of-generation tokens to -inf); tandem's `ignore_eos` only keeps going."""
    from engine.protocol import SamplingParams

    n = tokens + 1
    # min_tokens masks EOS only when ignore_eos is off (engine/sampler.py): masked for all n.
    greedy = SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=not mask_eos, min_tokens=n if mask_eos else 0
    )
    out = llm.generate([ids], greedy)[0]
    return 1.0 / out.tpot, list(out.token_ids)


def tandem_prefill(llm, ids: list[int]) -> float:
    from engine.protocol import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([ids], one)
    return len(ids) / (time.perf_counter() - t0)


def chat_ids(llm, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    out = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5: a dict


def random_ids(seed: int, n: int) -> list[int]:
    """Token ids a prompt of exactly n tokens; ordinary vocabulary (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


# --------------------------------------------------------------------------- sections


def alternate(rounds: int, run_llama, run_tandem, name: str, unit: str) -> list[dict]:
    """`rounds` rounds, the order flipped every round (drift of the box's load cancels)."""
    out = []
    for r in range(rounds):
        first_llama = r % 2 == 0
        order = [("llama", run_llama), ("tandem", run_tandem)]
        row: dict = {}
        for engine, fn in order if first_llama else order[::-1]:
            row[engine] = fn(r)
        row["ratio"] = row["tandem"] / row["llama"]
        row["load_avg_1m"] = os.getloadavg()[0]
        log(round_line(name, r + 1, row, unit))
        out.append(row)
    return out


def decode_section(args, layout, weights, quant: str | None) -> dict:
    gguf = weights.q8_0_gguf if quant else weights.bf16_gguf
    name = {"int8": "int8", "int8-w8a8": "w8a8"}.get(quant, "decode")
    llm = tandem_llm(weights, quant)
    ids = chat_ids(llm, CHAT_PROMPTS[1])
    set_threads(args.threads)
    tandem_decode(llm, ids, 8)  # warm-up: first calls, lazy allocations
    bench_info: dict = {}

    def run_llama(_r: int) -> float:
        row = llama_bench(layout, gguf, args.threads, 0, args.tokens)
        bench_info.update({k: row.get(k) for k in ("build_commit", "build_number", "type_k")})
        return row["avg_ts"]

    def run_tandem(_r: int) -> float:
        return tandem_decode(llm, ids, args.tokens)[0]

    rows = alternate(args.rounds, run_llama, run_tandem, name, "tok/s")
    agree = agreement_check(args, layout, gguf, llm)
    return {"rounds": rows, "llama_bench": bench_info, "agreement": agree}


def agreement_check(args, layout, gguf: Path, llm) -> dict:
    """Greedy tokens of both engines on the chat prompts, compared position by position.
    One thread each: nothing here is timed, and on a shared 2-core box two spinning threads
    can stall for a scheduler slice at every barrier (seconds a token)."""
    pairs, gaps = [], []
    set_threads(1)
    with LlamaServer(layout, gguf, 1, 1, 4096) as server:
        for prompt in CHAT_PROMPTS[: args.agree_prompts]:
            ids = chat_ids(llm, prompt)
            theirs = server.greedy(ids, args.tokens)
            ours = tandem_decode(llm, ids, args.tokens - 1, mask_eos=True)[1]
            pairs.append((ours, theirs))
            div = agreement([(ours, theirs)])["first_divergence"][0]
            if div is not None and div < min(len(ours), len(theirs)):
                # How near a tie llama.cpp saw where the two first part, and whether
                # tandem's token was its runner-up.
                top = server.top2(ids + theirs[:div])
                gaps.append({"at": div, "llama_top2": top, "tandem_token": ours[div]})
    set_threads(args.threads)
    result = agreement(pairs) | {"divergences": gaps, "threads": 1}
    margins = [round(g["llama_top2"][0][1] - g["llama_top2"][1][1], 3) for g in gaps]
    log(
        f"agreement ({gguf.name}): {result['equal']}/{result['total']} tokens equal, "
        f"first divergence per prompt {result['first_divergence']}; llama.cpp's top-2 "
        f"logprob gap there {margins}"
    )
    return result


def prefill_section(args, layout, weights) -> dict:
    llm = tandem_llm(weights)
    set_threads(args.threads)
    tandem_prefill(llm, random_ids(10_000, args.prompt_tokens))  # warm-up

    def run_llama(_r: int) -> float:
        return llama_bench(layout, weights.bf16_gguf, args.threads, args.prompt_tokens, 0)["avg_ts"]

    def run_tandem(r: int) -> float:
        return tandem_prefill(llm, random_ids(r, args.prompt_tokens))

    rows = alternate(args.rounds, run_llama, run_tandem, "prefill", "tok/s")
    return {"rounds": rows}


def serve_bench(url: str, args, seed: int, n: int, output_len: int) -> dict:
    """tandem's streaming client against an OpenAI-compatible server: all requests at once."""
    from bench.client import run_benchmark
    from bench.config import COMPLETIONS, BenchConfig

    config = BenchConfig(
        base_url=url,
        endpoint=COMPLETIONS,
        num_prompts=n,
        input_len=args.serve_input,
        output_len=output_len,
        seed=seed,
        vocab_low=100,
        vocab_high=40000,
        temperature=0.0,
        ignore_eos=True,
        progress=False,
    )
    m = asyncio.run(run_benchmark(config)).metrics
    if m.failed or m.total_output_tokens != n * output_len:
        raise RuntimeError(
            f"{url}: {m.failed} failed, {m.total_output_tokens} output tokens of {n * output_len}"
        )
    return {"output_tok_s": m.output_tok_s, "duration_s": m.duration_s}


def concurrent_section(args, layout, weights) -> dict:
    from bench.live_server import LiveServer

    n, per_slot = args.concurrency, args.serve_input + args.serve_output + 64
    details: dict[str, list] = {"llama": [], "tandem": []}
    workdir = Path(tempfile.mkdtemp(prefix="llamacpp-compare-"))

    def measured(engine: str, url: str, r: int) -> float:
        serve_bench(url, args, 1000 + r, 2, 4)  # warm-up: first requests, lazy allocations
        result = serve_bench(url, args, r, n, args.serve_output)
        details[engine].append(result)
        return result["output_tok_s"]

    def run_llama(r: int) -> float:
        with LlamaServer(layout, weights.bf16_gguf, args.threads, n, n * per_slot) as server:
            return measured("llama", server.url, r)

    def run_tandem(r: int) -> float:
        flags = ["--mode", "colocated", "--replicas", "1", "--dtype", "bfloat16"]
        flags += ["--num-cpus", str(args.threads)]
        server = LiveServer(weights.hf_dir, workdir / f"round{r}", *flags).start(300)
        try:
            return measured("tandem", server.url, r)
        finally:
            server.stop()

    try:
        rows = alternate(args.rounds, run_llama, run_tandem, "concurrent", "output tok/s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    topology = f"tandem serve --mode colocated --replicas 1 --num-cpus {args.threads}"
    return {"rounds": rows, "details": details, "tandem_topology": topology}


# --------------------------------------------------------------------------- main


def lscpu_summary() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(
        (k.strip(), v.strip())
        for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)
    )
    flags = set(fields.get("Flags", "").split())
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return {"model_name": fields.get("Model name"), "cpus": fields.get("CPU(s)"), "simd": simd}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens per decode round")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prefill prompt length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--serve-input", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--serve-output", type=int, default=128, help="output tokens per request")
    p.add_argument("--agree-prompts", type=int, default=len(CHAT_PROMPTS))
    p.add_argument("--only", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    p.add_argument("--skip-build", action="store_true", help="fail rather than build llama.cpp")
    p.add_argument("--sdist", default=None, help="a downloaded llama-cpp-python sdist")
    p.add_argument("--model", default=None, help="the GGUF file (default: tandem fetch-model's)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    return args


def setup(args) -> tuple[Layout, Weights]:
    layout = Layout(cache_dir())
    if not layout.built():
        if args.skip_build:
            raise BuildError(f"--skip-build, but llama.cpp is not built in {layout.build}")
        ensure_sdist(layout, args.sdist)
        build(layout)
    if args.model is None:
        from tools.real_model import model_path

        args.model = str(model_path())
    if not Path(args.model).is_file():
        raise BuildError(f"{args.model} is missing: run `tandem fetch-model` first")
    return layout, prepare_weights(layout, Path(args.model))


def run(args) -> dict:
    layout, weights = setup(args)
    set_threads(args.threads)
    result = {
        "machine": machine_info(args.threads),
        "lscpu": lscpu_summary(),
        "llama_cpp": {"llama_cpp_python": VERSION, "commit": source_commit(layout)},
        "weights": {k: str(v) for k, v in vars(weights).items()},
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "sections": {},
    }
    log(f"llama.cpp {result['llama_cpp']['commit']} (llama-cpp-python {VERSION} sdist)")
    runners = {
        "decode": lambda: decode_section(args, layout, weights, None),
        "prefill": lambda: prefill_section(args, layout, weights),
        "concurrent": lambda: concurrent_section(args, layout, weights),
        "int8": lambda: decode_section(args, layout, weights, "int8"),
        "w8a8": lambda: decode_section(args, layout, weights, "int8-w8a8"),
    }
    for name in SECTIONS:
        if name in args.only:
            log(f"== {name}")
            section = runners[name]()
            section["summary"] = summarize_section(section["rounds"])
            result["sections"][name] = section
    result["load_avg_end"] = list(os.getloadavg())
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except BuildError as e:
        print(f"llamacpp_compare: {e}", file=sys.stderr)
        return 2
    print(format_table(result["sections"]))
    if args.json:
        write_json(args.json, result)
        plot(result["sections"], str(Path(args.json).with_suffix(".png")))  # beside the JSON
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
