"""Engine replicas (--data-parallel-size) and their tensor-parallel ranks
(--tensor-parallel-size): the names their processes go by (heartbeats, /health, logs), and the
GPUs each replica gets, serving and offline alike."""

from __future__ import annotations

import os

from shared.config import Config, ConfigError
from shared.model_config import load_model_config, resolve_model_source


def replica_name(component: str, replica: int, num_replicas: int) -> str:
    """ "scheduler", "executor-0" with one replica; "r1-scheduler", "r1-executor-0" (replica 1)
    with several."""
    return component if num_replicas == 1 else f"r{replica}-{component}"


def replica_of(name: str, config: Config) -> int | None:
    """The replica an engine process (a name of `engine_components`) belongs to; None for any
    other name (a frontend, a tokenizer worker)."""
    if name not in engine_components(config):
        return None
    if config.data_parallel_size == 1:
        return 0
    return int(name[1 : name.index("-")])


def engine_component(component: str, config: Config) -> str:
    """This process's name: `component` of its replica (--data-parallel-rank)."""
    return replica_name(component, config.replica, config.data_parallel_size)


def engine_components(config: Config) -> list[str]:
    """Every engine process a frontend hears from: each replica's scheduler and executor ranks."""
    names = ["scheduler", *(f"executor-{t}" for t in range(config.tensor_parallel_size))]
    replicas = config.data_parallel_size
    return [replica_name(name, r, replicas) for r in range(replicas) for name in names]


def replica_gpus(config: Config) -> list[str] | None:
    """With several replicas on GPUs, the GPUs they share out, one per rank and replica after
    replica (`replica_devices`); None where they run on the CPU, or there is one replica.
    Fewer GPUs than ranks in all: the replicas take them in turn, several to a GPU, where each
    one's KV cache is sized in bytes or blocks (--kv-cache-memory-bytes,
    --num-gpu-blocks-override; a share of the GPU's memory would count the others'), else
    refused."""
    replicas, ranks = config.data_parallel_size, config.tensor_parallel_size
    if replicas == 1 or config.device == "cpu":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [gpu for gpu in visible.split(",") if gpu.strip()]
    else:
        import torch  # here only: `kvflow serve` needs it for this count alone

        gpus = [str(gpu) for gpu in range(torch.cuda.device_count())]
    if not gpus and config.device == "auto":
        return None  # no GPU: the replicas run on the CPU
    sized = config.kv_cache_memory_bytes is not None or config.num_gpu_blocks_override is not None
    if len(gpus) < replicas * ranks and not (sized and len(gpus) >= ranks):
        raise ConfigError(
            f"--data-parallel-size {replicas} x --tensor-parallel-size {ranks} needs "
            f"{replicas * ranks} GPUs; {len(gpus)} are visible (replicas may share GPUs where"
            " --kv-cache-memory-bytes sizes each one's KV cache)"
        )
    return gpus


def replica_devices(gpus: list[str] | None, replica: int, config: Config) -> dict[str, str]:
    """The environment that gives replica r GPUs r*N..(r+1)*N-1 of `gpus` (N: its ranks);
    nothing where `replica_gpus` found none to share out. With prefill/decode disaggregation
    over GPU memory (--kv-buffer-device cuda) the others follow, unused but visible: a decode
    replica opens a prefill replica's handover slots by CUDA IPC, which needs their GPU."""
    if gpus is None:
        return {}
    ranks = config.tensor_parallel_size
    first = replica * ranks
    own = [gpus[(first + i) % len(gpus)] for i in range(ranks)]
    if config.prefill_replicas and config.kv_buffer_device == "cuda":
        own += [gpu for gpu in gpus if gpu not in own]
    return {"CUDA_VISIBLE_DEVICES": ",".join(own)}


def experts_across_replicas(config: Config) -> bool:
    """Whether a mixture of experts' experts spread over every replica's ranks (data parallel,
    expert parallel, and a model with experts): the replicas then run their steps together
    (services/executor/parallel/lockstep.py)."""
    if config.data_parallel_size == 1 or not config.enable_expert_parallel:
        return False
    return load_model_config(resolve_model_source(config.model)).moe is not None
