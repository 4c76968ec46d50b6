#!/usr/bin/env bash
# On the GPU machine: builds zeroalloc, runs the GPU tests (label gpu, and the sim suites),
# the PyTorch bit-exactness test and the benchmarks, and prints a short table last.
# liburing is not installed there: its Debian packages travel in .deps/ (see README).
# Logs and JSON are packed into $OUT/gpu-check-logs.tar.gz (the device tool returns at most 8
# files); $OUT defaults to ./gpu-out. The figures the Python tests print come last.
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:-gpu-out}; mkdir -p "$final"
out=$(mktemp -d /tmp/gpu-check.XXXXXX)
trap 'tar czf "$final/gpu-check-logs.tar.gz" -C "$out" . 2>/dev/null' EXIT
prefix=/tmp/zeroalloc-prefix
if ! ls /usr/include/liburing.h >/dev/null 2>&1; then
  for deb in .deps/liburing*.deb; do dpkg -x "$deb" "$prefix"; done
fi
if ! ls /usr/include/nlohmann/json.hpp >/dev/null 2>&1; then
  for deb in .deps/nlohmann-json*.deb; do dpkg -x "$deb" "$prefix"; done
fi
export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

step() { echo; echo "== $*"; }
status=0
step build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix/usr" >"$out/configure.log" 2>&1 \
  && ninja -C build -j16 >"$out/build.log" 2>&1 || { tail -40 "$out/configure.log" "$out/build.log"; exit 1; }

step "ctest (gpu and sim labels)"
(cd build && ctest --output-on-failure -j1 2>&1) | tee "$out/ctest.log" | tail -15 || status=1
grep -q "tests passed, 0 tests failed" "$out/ctest.log" || status=1

step "caching_allocator_bench"
build/bench/caching_allocator_bench --benchmark_repetitions=11 --benchmark_report_aggregates_only=true \
  --benchmark_out="$out/alloc_bench.json" --benchmark_out_format=json 2>&1 | grep -E "median|Benchmark" | tee "$out/alloc_bench.txt"

step "use hints: host time per Llama layer, one call per tensor vs one per layer"
ZEROALLOC_DEVICE=cuda build/bench/hint_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  2>&1 | grep -E "median|Benchmark" | tee "$out/hint_bench.txt"

step "migration throughput: the migrator vs cudaMemcpyAsync"
build/bench/migration_bench --gib 4 --rounds 5 2>&1 | tee "$out/migration.txt" | tail -7

step "what a remap costs, idle and while copies run (Note [What a remap costs])"
build/bench/remap_bench --chunks 16 2>&1 | tee "$out/remap.txt" | tail -12

# GPU_CHECK_SKIP: names of steps to leave out, when their figures are recorded: torch_empty,
# preload_overhead, demo (about 40 s), optimizer_step (about 60 s), llama (about 140 s). Everything together runs
# about 10 minutes, the device tool's limit per command: skip some of them there.
skip=" ${GPU_CHECK_SKIP:-} "
step "torch.empty + del through zeroalloc vs native"
[[ $skip == *" torch_empty "* ]] && echo skipped || python3 bench/python/torch_empty_bench.py --rounds 4 --library build/libzeroalloc.so 2>&1 | tee "$out/torch_empty.txt" | tail -12

step "training step time with libzeroalloc.so preloaded vs without"
[[ $skip == *" preload_overhead "* ]] && echo skipped || python3 bench/python/preload_overhead_bench.py --library build/libzeroalloc.so --steps 200 2>&1 \
  | tee "$out/preload_overhead.txt" | tail -2

step "training trace: zeroalloc vs PyTorch native, same trace"
build/demo/zeroalloc-demo --emit-trace "$out/trace.txt" >/dev/null
build/demo/zeroalloc-demo --trace "$out/trace.txt" 2>&1 | tee "$out/demo.txt" | tail -12
python3 bench/python/replay_trace_torch.py "$out/trace.txt" 2>&1 | tee "$out/replay_native.txt" | tail -1
python3 bench/python/replay_trace_torch.py --expandable "$out/trace.txt" 2>&1 | tee "$out/replay_expandable.txt" | tail -1

step "Python: package, zeroalloc.torch, PyTorch training with losses bit for bit"
ZEROALLOC_LIBRARY=$PWD/build/libzeroalloc.so python3 -m pytest -q -s -rs tests/python \
  >"$out/pytest.log" 2>&1 || status=1
tail -8 "$out/pytest.log"
echo "-- figures printed by the Python tests"
grep -E "^(every-step offload|Trainer under|ZEROALLOC_TORCH=zeroalloc|expandable_segments=|  cuMemCreate passed)" \
  "$out/pytest.log" || true

step "demo: a Llama-style model trained under a limit through offload, against the whole device"
[[ $skip == *" demo "* ]] && echo skipped || { python3 demo/train_offload.py --library build/libzeroalloc.so \
  --report "$out/train" 2>&1 | tee "$out/demo_train.txt" | tail -4; [[ ${PIPESTATUS[0]} == 0 ]] || status=1; }

step "optimizer step placement: device, in place, bounce, zt.offload's step, migrate, CPU Adam"
[[ $skip == *" optimizer_step "* ]] && echo skipped || python3 bench/python/optimizer_step_bench.py \
  --library build/libzeroalloc.so 2>&1 | tee "$out/optimizer_step.txt" | tail -13

step "Llama 1.3B: native, zeroalloc, offload under a limit, FSDP2 with CPUOffloadPolicy"
[[ $skip == *" llama "* ]] && echo skipped || python3 bench/python/offload_llama_bench.py \
  --library build/libzeroalloc.so --warmup 8 --steps 8 --overlap-bytes 0,2147483648 --log-dir "$out/llama" 2>&1 | tee "$out/llama.txt" | grep -v '^{' | tail -6

step summary
python3 - "$out" <<'PY'
import json, re, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = []
try:
    bench = json.loads((out / "alloc_bench.json").read_text())
    for b in bench["benchmarks"]:
        if b.get("aggregate_name") == "median":
            rows.append((b["run_name"], f'{b["real_time"]:.1f} {b["time_unit"]}'))
except Exception as e:
    rows.append(("alloc bench", f"missing ({e})"))
demo = (out / "demo.txt").read_text() if (out / "demo.txt").exists() else ""
m = re.search(r"peak reserved / peak allocated = ([0-9.]+)", demo)
rows.append(("trace ratio zeroalloc", m.group(1) if m else "missing"))
for name in ("replay_native", "replay_expandable"):
    try:
        line = (out / f"{name}.txt").read_text().strip().splitlines()[-1]
        rows.append((f"trace ratio {name}", f'{json.loads(line)["ratio"]:.3f}'))
    except Exception as e:
        rows.append((f"trace ratio {name}", f"missing ({e})"))
for line in (out / "torch_empty.txt").read_text().splitlines() if (out / "torch_empty.txt").exists() else []:
    if re.match(r"^\s*[0-9.]+ [KMG]?i?B ", line):
        rows.append(("torch.empty+del", line.strip()))
for line in (out / "preload_overhead.txt").read_text().splitlines() if (out / "preload_overhead.txt").exists() else []:
    if line.startswith("step time:"):
        rows.append(("preload overhead", line[len("step time: "):]))
for line in (out / "migration.txt").read_text().splitlines() if (out / "migration.txt").exists() else []:
    if re.match(r"^(device -> host|host -> device|both at once)", line):
        rows.append(("migration GB/s (ours, memcpy, ratio)", line.strip()))
for line in (out / "optimizer_step.txt").read_text().splitlines() if (out / "optimizer_step.txt").exists() else []:
    if re.match(r"^(device|in_place|bounce|shipped|migrate|host_adam)_", line):
        rows.append(("AdamW step s (vs device)", line.strip()))
for line in (out / "llama.txt").read_text().splitlines() if (out / "llama.txt").exists() else []:
    if re.match(r"^(native|zeroalloc|offload\S*|fsdp2) ", line):
        rows.append(("Llama 1.3B step s, tokens/s, vs native, vs fsdp2", line.strip()[:90]))
ctest = (out / "ctest.log").read_text() if (out / "ctest.log").exists() else ""
m = re.search(r"(\d+% tests passed.*)", ctest)
rows.append(("ctest", m.group(1) if m else "missing"))
py = (out / "pytest.log").read_text() if (out / "pytest.log").exists() else ""
m = re.findall(r"(\d+ (?:passed|failed|skipped)[^\n]*)", py)
rows.append(("pytest tests/python", m[-1] if m else "missing"))
w = max(len(r[0]) for r in rows)
for k, v in rows:
    print(f"{k:<{w}}  {v}")
PY
exit $status
