"""An offline `kvflow.LLM` on N ranks whose LoRA adapter's files vanish while it runs, in a
process of its own:

    python -m tests.integration.tp_lost_adapter --job JOB.json --out RESULT.json

JOB.json: the model folder, engine settings ("config"), a prompt (token ids), max_tokens and
three adapters ([name, id, folder] each). With one device slot and one adapter kept in host
memory, each adapter runs in turn (the third's load evicts the first from host memory), then
the first again after its folder was removed: that plan cannot be run. RESULT.json: the
tokens of the second adapter's runs before and after, and the error of the failed run.
"""

from __future__ import annotations

import json
import shutil

from kvflow import LoRARequest, SamplingParams
from tests.integration.tp_generate import open_job


def main() -> None:
    job, out, llm = open_job()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    first, second, third = (LoRARequest(*lora) for lora in job["loras"])

    def run(lora: LoRARequest) -> list[int]:
        return llm.generate([job["prompt"]], params, lora_request=lora)[0].token_ids

    run(first)
    before = run(second)
    run(third)  # its load leaves only the adapter in the slot in host memory
    shutil.rmtree(first.lora_path)
    try:
        run(first)
        error = None
    except Exception as exc:  # what the caller sees
        error = f"{type(exc).__name__}: {exc}"
    after = run(second)
    out.write_text(json.dumps({"before": before, "after": after, "error": error}))


if __name__ == "__main__":
    main()
