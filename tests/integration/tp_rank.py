"""One rank of a tensor-parallel engine on CPU, as a process of its own (gloo):

    python -m tests.integration.tp_rank --rank R --world N --init FILE --job JOB.json --out DIR

JOB.json holds the model folder (or null: the embedded SmolLM2), other engine settings
("config"), the prompts (token ids) and max_tokens. Every rank runs the same engine loop on the
same requests (the same plans, as the scheduler's broadcast will give them) and rank R writes
the greedy tokens it sampled to DIR/rank<R>.json: every rank must have sampled the same.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from services.executor.model_runner import ModelRunner
from services.executor.tensor_parallel import TensorParallel
from services.scheduler.engine_core import EngineCore
from services.scheduler.handshake import scheduler_config
from services.scheduler.scheduler import Scheduler
from shared.config import Config
from shared.protocol import EngineRequest, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=args.world
    )
    try:
        tokens = run(job, TensorParallel(args.rank, args.world))
    finally:
        dist.destroy_process_group()
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(tokens))


def run(job: dict, tp: TensorParallel) -> list[list[int]]:
    settings = {"dtype": "float32", "device": "cpu", "max_model_len": 512, **job["config"]}
    config = Config(model=job["model"], **settings)
    runner = ModelRunner(config, tp)
    engine = EngineCore(Scheduler(scheduler_config(config, runner.ready_message("tp"))), runner)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    for index, prompt in enumerate(job["prompts"]):
        engine.add_request(
            EngineRequest(request_id=str(index), prompt_token_ids=prompt, sampling_params=params)
        )
    tokens: list[list[int]] = [[] for _ in job["prompts"]]
    while engine.has_unfinished():
        for output in engine.step():
            tokens[int(output.request_id)].extend(output.new_token_ids)
    return tokens


if __name__ == "__main__":
    main()
