"""Offline throughput and decode latency of the engine, through kvflow's Python API.

Prompts are random token ids (distinct, seeded), so any model shape runs without a tokenizer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvflow import LLM, EngineCore, EngineRequest, LoRARequest, SamplingParams
from shared.config import Config
from shared.gc_heap import collections_watched


def random_prompts(num: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """`num` prompts of random token ids; lengths[i] tokens each (the same seed, the same ids)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def draw_lengths(bounds: tuple[int, int], num: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(bounds[0], bounds[1] + 1, (num,), generator=generator).tolist()


def _llm(config: Config) -> LLM:
    return LLM(**{k: getattr(config, k) for k in Config.__dataclass_fields__})


def _late_compiles(llm: LLM) -> list[str]:
    """The Triton kernel variants this process met after the warm-up so far (on a GPU)."""
    if llm.runner.device.type != "cuda":
        return []
    from kernels.triton_compile_watch import late_compiles  # Triton: on GPUs only

    return list(late_compiles().variants)


def _lora_ids(llm: LLM, paths: list[str]) -> list[int]:
    """The adapters at `paths` registered (ids 1, 2, ...); none: the base model alone."""
    if paths and not llm.config.enable_lora:
        raise SystemExit("--lora-paths needs --enable-lora (and --max-loras for several)")
    return [llm.add_lora(LoRARequest(f"lora-{i}", i, path)) for i, path in enumerate(paths, 1)]


def _device_name(llm: LLM) -> str:
    device = llm.runner.device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class Workload:
    """An offline run's requests: random-token prompts, their lengths and params, and the
    LoRA adapters they run under (spread evenly; none without --lora-paths)."""

    prompts: list[list[int]]
    input_lens: list[int]
    params: list[SamplingParams]
    adapters: list[LoRARequest]

    def per_prompt(self) -> list[LoRARequest] | None:
        """Prompt i's adapter, in turn; None runs the base model."""
        if not self.adapters:
            return None
        return [self.adapters[i % len(self.adapters)] for i in range(len(self.prompts))]

    def lora_ids(self) -> list[int] | None:
        loras = self.per_prompt()
        return [r.lora_int_id for r in loras] if loras else None


def _workload(llm: LLM, config: Config, args: argparse.Namespace) -> Workload:
    vocab = llm.runner.model_config.vocab_size
    input_lens = draw_lengths(args.input_len, args.num_prompts, config.seed + 1)
    output_lens = draw_lengths(args.output_len, args.num_prompts, config.seed + 2)
    prompts = random_prompts(args.num_prompts, input_lens, vocab, config.seed)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=args.ignore_eos)
        for n in output_lens
    ]
    pairs = zip(_lora_ids(llm, args.lora_paths), args.lora_paths, strict=True)
    adapters = [LoRARequest(f"lora-{i}", i, path) for i, path in pairs]
    return Workload(prompts, input_lens, params, adapters)


def _warm_up(llm: LLM, config: Config, adapters: list[LoRARequest]) -> None:
    """A short request with every adapter on every replica, so that the adapters are read and
    put in slots outside the timing (prompt i goes to replica i mod N)."""
    vocab = llm.runner.model_config.vocab_size
    warm = [lora for lora in adapters or [None] for _ in range(config.data_parallel_size)]
    prompts = random_prompts(len(warm), [16] * len(warm), vocab, config.seed + 3)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts, params, lora_request=warm)


def throughput(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    if (args.profile_steps or args.profile_run) and config.data_parallel_size > 1:
        raise SystemExit("profiles are of one engine: not with --data-parallel-size")
    llm = _llm(config)
    work = _workload(llm, config, args)
    _warm_up(llm, config, work.adapters)
    compiled_before = len(_late_compiles(llm))
    counts = llm.runner.model.expert_tokens  # a mixture of experts': its choices from here
    if counts is not None:
        counts.zero_()
    start = time.perf_counter()
    loras = work.per_prompt()
    with collections_watched() as collections:
        results = llm.generate(work.prompts, work.params, lora_request=loras, show_progress=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(r.token_ids) for r in results)
    total = num_out + sum(work.input_lens)
    report = {
        "benchmark": "throughput",
        "model": llm.runner.source.name,
        "device": _device_name(llm),
        "num_prompts": args.num_prompts,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "seconds": round(elapsed, 3),
        "requests_per_s": round(args.num_prompts / elapsed, 2),
        "output_tok_per_s": round(num_out / elapsed, 1),
        "total_tok_per_s": round(total / elapsed, 1),
        "output_tokens": num_out,
        "total_tokens": total,
        "matmul_parameters": _matmul_parameters(llm.runner.model),
        "num_preemptions": sum(s.num_preemptions for s in llm.replica_stats()),
        "kv_cache_tokens": llm.runner.num_blocks * llm.runner.block_size,  # in each replica
        "kv_context_tokens": _kv_context_tokens(llm),
        "lora_adapters": len(work.adapters),
        # Compiled inside the timing, had the warm-up missed them (replica 0's process).
        "triton_compiles_in_timed_run": _late_compiles(llm)[compiled_before:],
        # Python's collections in the timed run (in the caller's process), by generation.
        "gc_in_timed_run": collections.report(),
        "config": _engine_summary(config),
    }
    if counts is not None:
        report["expert_load"] = expert_load(llm.runner.model)
    report.update(_throughput_profiles(llm, config, args, work))
    return report


def expert_load(model: torch.nn.Module) -> dict[str, Any]:
    """A mixture of experts' choices by real tokens since its counts were zeroed, every
    layer's added up (replica 0's: all its ranks route alike): by expert, and with expert
    parallelism by the rank holding the expert, with the busiest rank's share over an even
    one's (1.0: balanced)."""
    per_expert = model.expert_tokens.tolist()
    report: dict[str, Any] = {"per_expert": per_expert}
    ranks = model.expert_ranks()
    if ranks and ranks[0] >= 0:
        per_rank = [0] * (max(ranks) + 1)
        for rank, count in zip(ranks, per_expert, strict=True):
            per_rank[rank] += count
        report["per_rank"] = per_rank
        even = sum(per_rank) / len(per_rank)
        report["busiest_rank_over_even"] = round(max(per_rank) / even, 3) if even else None
    return report


def _throughput_profiles(
    llm: LLM, config: Config, args: argparse.Namespace, work: Workload
) -> dict[str, Any]:
    """--profile-steps: the first prefill steps of fresh prompts and the decode steps;
    --profile-run: the whole workload again on fresh prompts."""
    profiles: dict[str, Any] = {}
    if not (args.profile_steps or args.profile_run):
        return profiles
    from benchmarks.step_profile import profile_decode, profile_prefill, profile_run

    vocab = llm.runner.model_config.vocab_size
    prompt_loras = work.lora_ids()
    if args.profile_steps:
        # Prompts the prefix cache has not seen, or the profiled steps would compute little.
        fresh = random_prompts(args.num_prompts, work.input_lens, vocab, config.seed + 7)
        profiles["prefill_profile"] = profile_prefill(
            llm.engine, fresh, work.params, 3, prompt_loras
        )
        profiles["decode_profile"] = profile_decode(
            llm.engine, work.prompts, work.params, args.profile_steps, prompt_loras
        )
        profiles["gpu_busy_fraction"] = profiles["decode_profile"]["gpu_busy_fraction"]
    if args.profile_run:
        fresh = random_prompts(args.num_prompts, work.input_lens, vocab, config.seed + 8)
        # the run's 30 costliest kernels: enough to set beside vLLM's kernel table
        profiles["run_profile"] = profile_run(llm.engine, fresh, work.params, prompt_loras, top=30)
    return profiles


def latency(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    if config.data_parallel_size > 1:
        raise SystemExit("latency times one engine's steps: not with --data-parallel-size")
    llm = _llm(config)
    engine = llm.engine
    vocab = llm.runner.model_config.vocab_size
    input_len, output_len = args.input_len[0], args.output_len[0]
    lora_id = _lora_ids(llm, args.lora_paths[:1])[0] if args.lora_paths else 0
    _decode_step_times(engine, 2, 16, 8, vocab, config.seed + 100, lora_id)  # warm-up
    rows = []
    for batch in args.batch_sizes:
        times = _decode_step_times(engine, batch, input_len, output_len, vocab, batch, lora_id)
        # The last half of the steps are pure decode whatever the prefill took.
        decode = sorted(times[len(times) // 2 :])
        rows.append(
            {
                "batch_size": batch,
                "itl_ms_median": round(1000 * statistics.median(decode), 3),
                "itl_ms_p90": round(1000 * decode[int(0.9 * (len(decode) - 1))], 3),
                "decode_tok_per_s": round(batch / statistics.median(decode), 1),
                "weight_bytes_per_step": _step_weight_bytes(llm.runner.model, batch),
            }
        )
    report = {
        "benchmark": "latency",
        "model": llm.runner.source.name,
        "device": _device_name(llm),
        "input_len": input_len,
        "output_len": output_len,
        "weight_bytes": _matmul_weight_bytes(llm.runner.model),  # on each rank; a step's: rows
        "kv_cache_tokens": llm.runner.num_blocks * llm.runner.block_size,
        "kv_context_tokens": _kv_context_tokens(llm),
        "lora_adapter": args.lora_paths[0] if args.lora_paths else None,
        "results": rows,
        "config": _engine_summary(config),
    }
    if args.profile_steps:
        from benchmarks.step_profile import profile_decode

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        report["decode_profiles"] = {
            batch: profile_decode(
                engine,
                random_prompts(batch, [input_len] * batch, vocab, seed=batch + 1000),
                [params] * batch,
                args.profile_steps,
                [lora_id] * batch,
            )
            for batch in args.batch_sizes
        }
    return report


def _decode_step_times(
    engine: EngineCore,
    batch: int,
    input_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    lora_id: int = 0,
) -> list[float]:
    """Wall time of every engine step while `batch` requests generate `output_len` tokens
    (under the LoRA adapter `lora_id`, if not 0)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, [input_len] * batch, vocab, seed)):
        engine.add_request(
            EngineRequest(
                request_id=f"bench-{seed}-{i}",
                prompt_token_ids=prompt,
                sampling_params=params,
                lora_id=lora_id,
            )
        )
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()  # returns after sampling, which waits for the GPU
        times.append(time.perf_counter() - start)
    return times


def _kv_context_tokens(llm: LLM) -> int:
    """The context the KV cache holds, counted as vLLM's "GPU KV cache size" does: requests of
    max_model_len that fit at once, times max_model_len (with layer groups, a sliding group
    holds only its window of each)."""
    runner = llm.runner
    per_sequence = runner.kv_groups.blocks_per_sequence(runner.max_model_len, runner.block_size)
    return int(runner.num_blocks / per_sequence * runner.max_model_len)


def _matmul_weights(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The weights a step multiplies by, quantized ones and their scales included: all but an
    untied embedding, of which it reads rows (by id: a tied weight counts once)."""
    tensors = {id(p): p for p in model.parameters()}
    quantized = (  # qweight, weight_scale, a GGUF layer's qweight0, qweight1, FP8 experts ...
        b
        for n, b in model.named_buffers()
        if n.rpartition(".")[2].startswith(("qweight", "weight_scale", "experts_"))
    )
    tensors.update({id(b): b for b in quantized})
    if not model.config.tie_word_embeddings:
        tensors.pop(id(model.embed_tokens.weight))
    return tensors


def _step_weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """The weight bytes a decode step of `batch` tokens reads: all of _matmul_weights but, in a
    mixture of experts, only the experts its tokens choose, as many distinct ones a layer as
    an even router picks on average: E (1 - (1 - k / E) ** batch)."""
    moe = model.config.moe
    weights = _matmul_weights(model)
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    experts = sum(
        t.numel() * t.element_size()
        for key, t in weights.items()
        if ".experts_" in names.get(key, "")
    )
    dense = sum(t.numel() * t.element_size() for t in weights.values()) - experts
    if moe is None:
        return dense
    chosen = 1.0 - (1.0 - moe.top_k / moe.num_experts) ** batch
    return dense + round(experts * chosen)


def _matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters a step multiplies by: every linear layer's K x N, however it is stored
    (packed int4 holds 8 per element, and scales are not parameters)."""
    # Linear layers, by the shape they declare (benchmarks read the model, not executor types).
    layers = [m for m in model.modules() if hasattr(m, "in_features")]
    return sum(int(m.in_features) * int(m.out_features) for m in layers)


def _matmul_weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _matmul_weights(model).values())


def _engine_summary(config: Config) -> dict[str, Any]:
    keys = (
        "load_format",
        "dtype",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "enforce_eager",
        "disable_pdl",
        "tensor_parallel_size",
        "disable_custom_all_reduce",
        "data_parallel_size",
        "gpu_memory_utilization",
        "quantization",
        "kv_cache_dtype",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
    )
    return {k: getattr(config, k) for k in keys}
