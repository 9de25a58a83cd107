#!/usr/bin/env bash
# Structured output on a GPU machine (docs/benchmarks.md, "structured output"): the host cost of the
# 20-field schema (sweeps/grammar_bench.py), then `kvflow serve` on the Qwen3-8B shape with
# dummy weights at 32 concurrent streams, unconstrained and with that schema on every request,
# alternated twice; last, constrained answers of the GPU server are checked against the schema.
#
#   bash scripts/device_structured.sh
#
# Carried: .whl/ (bash scripts/device_wheels.sh) and .peer/qwen3-8b.tar.xz.
set -uo pipefail
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
MODEL_DIR=/tmp/qwen3-8b
[ -d "$MODEL_DIR" ] || tar -xJf .peer/qwen3-8b.tar.xz -C /tmp || exit 1
status=0
run() {
    echo "=== $1: ${*:2}"
    "${@:2}" || { echo "=== $1 failed (exit $?)"; status=1; }
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run grammar python3 -m sweeps.grammar_bench "$MODEL_DIR" --out "$OUT/grammar.json" \
    --extra-body /tmp/extra.json

python3 -m services serve "$MODEL_DIR" --load-format dummy --max-model-len 4096 --port 8100 \
    >"$OUT/serve.log" 2>&1 &
pid=$!
start=$SECONDS
until curl -sf http://127.0.0.1:8100/ready >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "server exited"; tail -30 "$OUT/serve.log"; exit 1; }
    ((SECONDS - start < 400)) || { echo "not ready after 400 s"; exit 1; }
    sleep 0.5
done
echo "ready after $((SECONDS - start)) s"

bench() {  # NAME [FLAGS...]: 160 requests, 32 at a time, 200 tokens in and out
    run "$1" python3 -m services bench serve --port 8100 --tokenizer "$MODEL_DIR" \
        --random-input-len 200 --random-output-len 200 --ignore-eos --num-prompts 160 \
        --max-concurrency 32 --seed "$2" --disable-tqdm --output-json "$OUT/$1.json" "${@:3}"
}
for round in 1 2; do
    bench "plain_$round" "1$round"
    bench "json_$round" "2$round" --extra-body "$(cat /tmp/extra.json)"
done

run check python3 - <<'EOF'
import json, urllib.request
import jsonschema
from sweeps.grammar_bench import SCHEMA_20, extra_body
ok = 0
for seed in range(16):
    body = {"model": "qwen3-8b", "prompt": "Describe a person:", "max_tokens": 800,
            "temperature": 1.0, "seed": seed, **extra_body()}
    request = urllib.request.Request("http://127.0.0.1:8100/v1/completions",
        data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    choice = json.load(urllib.request.urlopen(request))["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), SCHEMA_20)
        ok += 1
print(f"{ok} of 16 answers finished and validate against the 20-field schema")
assert ok >= 12
EOF
kill -INT $pid; wait $pid
grep -E "grammar tokenizer|warm-up|KV cache|listening" "$OUT/serve.log" | head
python3 - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def figures(name):
    data = json.loads((out / f"{name}.json").read_text())
    return data
print(json.dumps(json.loads((out / "grammar.json").read_text()), indent=1))
for name in ("plain_1", "json_1", "plain_2", "json_2"):
    d = figures(name)
    keys = [k for k in d if "tpot" in k or "ttft" in k or "throughput" in k]
    print(name, {k: d[k] for k in sorted(keys) if not isinstance(d[k], (list, dict))})
EOF
exit $status
