"""Greedy tokens from `kvflow.LLM` with --tensor-parallel-size N, in a process of its own (the
ranks' group and threads must not outlive a test):

    python -m tests.integration.tp_generate --job JOB.json --out RESULT.json [--job ... --out ...]

Several jobs run in turn, each `LLM` closed (its ranks and their group ended) before the next
starts: the process's start-up (some 2 s of imports) is paid once. A job that fails leaves its
traceback in error.txt beside its RESULT.json, and the next job runs.

JOB.json holds the model folder (or null: the embedded SmolLM2), other engine settings
("config", tensor_parallel_size among them), the prompts (token ids), max_tokens, top (the
logprobs asked for, 0 for none) and each prompt's LoRA adapter ([name, id, folder] or null).
RESULT.json holds each prompt's tokens and, per token, the ids of its top logprobs (spec.json
beside it, the drafts proposed, verified and accepted: `spec_counts`; host_tier.json, the
host tier's HostTierStats, or null without one). Rank 0
answers for the group: the other ranks run the plans it relays
(services/executor/rank_group.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import msgspec
import torch

from kvflow import LLM, LoRARequest, SamplingParams
from shared.protocol import SchedulerOutput

Result = tuple[list[int], list[list[int]]]  # tokens, and the top logprobs' ids at each
# A job's KV cache on CPU, unless its "config" sets one: the CPU default (1 GiB) is zeroed by
# every rank, 0.4 s of page faults each, for prompts that fill a few hundred KiB.
JOB_KV_CACHE_BYTES = 64 << 20


def generate(tmp_path: Path, *job: Any, **config: object) -> list[Result]:
    """Each prompt's greedy tokens (and top ids) from `kvflow.LLM` on `world` ranks, run in a
    process of its own, under its LoRA adapter in `loras` (name, id, folder; None: the base
    model); CPU and float32 unless `config` says otherwise. `job`: `make_job`'s arguments."""
    run_jobs({tmp_path: make_job(*job, **config)})
    return job_results(tmp_path)


def make_job(
    world: int,
    model: str | None,
    prompts: list[list[int]],
    max_tokens: int,
    top: int = 0,
    loras: list[tuple[str, int, str] | None] | None = None,
    **config: object,
) -> dict[str, Any]:
    """A job for `run_jobs`: `generate`'s, without its folder."""
    fields = {"model": model, "config": {**config, "tensor_parallel_size": world}}
    fields["loras"] = loras or [None] * len(prompts)
    return {**fields, "prompts": prompts, "max_tokens": max_tokens, "top": top}


def run_jobs(jobs: dict[Path, dict[str, Any]]) -> None:
    """Run the jobs, by the folder each writes its results to, in turn in one process of their
    own; `job_results` reads each one's."""
    argv = [sys.executable, "-m", "tests.integration.tp_generate"]
    for folder, fields in jobs.items():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "job.json").write_text(json.dumps(fields))
        (folder / "error.txt").unlink(missing_ok=True)
        argv += ["--job", str(folder / "job.json"), "--out", str(folder / "result.json")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def job_results(folder: Path) -> list[Result]:
    """The results of the job `run_jobs` ran in `folder`; the job's error fails the caller."""
    error = folder / "error.txt"
    assert not error.exists(), error.read_text()[-3000:]
    return [(tokens, tops) for tokens, tops in json.loads((folder / "result.json").read_text())]


def spec_counts(tmp_path: Path) -> dict[str, Any]:
    """What speculation did in the job in `tmp_path`: the draft tokens verified ("drafts")
    and accepted ("accepted"), and every set of drafts proposed ("proposals")."""
    return json.loads((tmp_path / "spec.json").read_text())


def job_files() -> list[tuple[Path, Path]]:
    """A job script's command line: each job (--job) and where its result goes (--out)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, action="append", required=True)
    args = parser.parse_args()
    if len(args.job) != len(args.out):
        parser.error("each --job needs its --out")
    return list(zip(args.job, args.out, strict=True))


def open_job() -> tuple[dict[str, Any], Path, LLM]:
    """A one-job script's command line: the job, where its result goes, and its `LLM`."""
    [(path, out)] = job_files()
    fields = json.loads(path.read_text())
    return fields, out, job_llm(fields)


def job_llm(fields: dict[str, Any]) -> LLM:
    """The `kvflow.LLM` a job's settings make (CPU, float32, a 64 MiB KV cache on CPU, unless
    its "config" says otherwise)."""
    settings = {"dtype": "float32", "device": "cpu", "max_model_len": 512, **fields["config"]}
    if settings["device"] == "cpu":
        settings.setdefault("kv_cache_memory_bytes", JOB_KV_CACHE_BYTES)
    return LLM(fields["model"], **settings)


def main() -> None:
    threads = torch.get_num_threads()  # a group of N ranks takes an Nth: each job its own
    for path, out in job_files():
        fields = json.loads(path.read_text())
        torch.set_num_threads(threads)
        try:
            llm = job_llm(fields)  # a start that fails closes what it started
            try:
                run(fields, out, llm)
            finally:
                llm.close()  # its ranks and their group end: the next job starts its own
                del llm  # its weights and KV cache go before the next job's load
        except Exception:  # read by the job's caller (job_results); the next job runs
            out.with_name("error.txt").write_text(traceback.format_exc())


def run(job: dict[str, Any], out: Path, llm: LLM) -> None:
    """Generate a job's prompts; write its results (RESULT.json, spec.json, host_tier.json)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=job["top"] or None
    )
    proposals = record_proposals(llm)
    results = []
    loras = [None if lora is None else LoRARequest(*lora) for lora in job["loras"]]
    for result in llm.generate(job["prompts"], params, lora_request=loras):
        completion = result.outputs[0]
        tops = [[top.token_id for top in logprob.top] for logprob in completion.logprobs]
        results.append((completion.token_ids, tops))
    out.write_text(json.dumps(results))
    spec = llm.engine.scheduler.spec_decode  # what speculation did, where it ran
    counts = {"drafts": spec.num_draft_tokens, "accepted": spec.num_accepted_tokens}
    out.with_name("spec.json").write_text(json.dumps({**counts, "proposals": proposals}))
    tier = llm.stats().host_tier  # the prefix cache's host tier (and disk tier), if any
    out.with_name("host_tier.json").write_text(json.dumps(msgspec.to_builtins(tier)))


def record_proposals(llm: LLM) -> list[list[int]]:
    """Every set of drafts rank 0 lays into a plan from now on, in order (by request within a
    plan)."""
    proposals: list[list[int]] = []
    prepare = llm.runner.prepare

    def recording_prepare(plan: SchedulerOutput) -> None:
        prepare(plan)
        proposals.extend(ids for _, ids in sorted(plan.spec_token_ids.items()))

    llm.runner.prepare = recording_prepare  # type: ignore[method-assign]
    return proposals


if __name__ == "__main__":
    main()
