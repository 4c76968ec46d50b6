#!/usr/bin/env bash
# On the GPU machine: builds zeroalloc, runs the GPU tests (label gpu: the gate, each test
# under a timeout), installs the wheel and runs `zeroalloc doctor` with no variable set, then
# the PyTorch tests and the benchmarks, and prints a short table last. Exits non-zero when a
# test fails, the package does not work, or the build fails.
# liburing and nlohmann/json are not installed there: their Debian packages travel in .deps/
# (see README). The wheel travels in .whl/ (built here by tests/package/wheel_test.sh or
# `pip wheel .`); without one, it is built there with the machine's scikit-build-core.
# With .baseline/ (an earlier commit's tree, `git archive`), the allocation benchmarks run
# for both builds in the same run, side by side.
# Logs and JSON are packed into $OUT/gpu-check-logs.tar.gz (the device tool returns at most 8
# files); $OUT defaults to ./gpu-out.
# GPU_CHECK_PREBUILT: a folder made by scripts/pack-build.sh on a machine with the same CUDA:
# its build is used instead of building here (the steps that build more, such as baseline
# and wheel, need the build tools all the same).
# GPU_CHECK_ONLY: the names of the steps to run, every other one skipped (for example
# "ctest programs").
# GPU_CHECK_SKIP: names of steps to leave out: ctest (the gate: leave it out only for a
# run of figures alone) programs (the user programs natively and under offload, compared:
# about 4 minutes for one mode, 7 for three at PROGRAMS_JOBS=12 on an H100; GPU_CHECK_PROGRAMS
# names some, GPU_CHECK_PROGRAMS_TIMEOUT bounds them, PROGRAMS_MODES=automatic,explicit,preload
# runs each mode against one native run) alloc_bench hint migration remap torch_empty
# preload_overhead trace wheel (the package and doctor, about 40 s) pytest host_step (about 30 s) demo (about 40 s) optimizer_step (about 60 s) llama (about
# 140 s) disk (about 30 s) big (the 16B model on three tiers, about 5 minutes;
# GPU_CHECK_BIG_LAYERS, _TIMEOUT) sweep (about 7 minutes, DeepSpeed ZeRO-2 and ZeRO-3 offload beside it; GPU_CHECK_SWEEP_MODES, _LIMITS,
# _WARMUP, _STEPS, _ARGS; with GPU_CHECK_SWEEP_MODES=offload,ds3nvme and _ARGS naming
# --nvme-path, --nvme-size, --host-limit and a model, DeepSpeed ZeRO-Infinity beside the
# NVMe tier) zero (two GPUs or more only: bench/python/zero_bench.py, about 5 minutes;
# GPU_CHECK_ZERO_MODES, _ARGS)
# baseline. GPU_CHECK_PYTEST: what pytest runs (default tests/python, about 7 minutes), split
# at spaces; GPU_CHECK_PYTEST_K: an expression for pytest's -k, whole ("merged or prepared");
# GPU_CHECK_PYTEST_JOBS: how many pytest processes share the tests, run at once (default 1);
# GPU_CHECK_PYTEST_PART=K/N: the K-th of N parts of the tests collected (every N-th test from
# the K-th), so that N calls run the whole suite.
# Everything together runs over 10 minutes, the device tool's limit per
# command: skip some of them there.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
final=${OUT:-gpu-out}; mkdir -p "$final"
out=$(mktemp -d /tmp/gpu-check.XXXXXX)
trap 'tar czf "$final/gpu-check-logs.tar.gz" -C "$out" . 2>/dev/null' EXIT
prefix=/tmp/zeroalloc-prefix
# Unpacked once: a second run of this script at the same time (see below) must not rewrite
# a library the first one's processes have loaded.
if [[ ! -e /usr/include/liburing.h && ! -e $prefix/usr/include/liburing.h ]]; then
  for deb in .deps/liburing*.deb; do dpkg -x "$deb" "$prefix"; done
fi
if [[ ! -e /usr/include/nlohmann/json.hpp && ! -e $prefix/usr/include/nlohmann/json.hpp ]]; then
  for deb in .deps/nlohmann-json*.deb; do dpkg -x "$deb" "$prefix"; done
fi
export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git_commit=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $git_commit" | tee "$out/commit.txt"

# A name that is no step's would leave that step in, minutes of device time: refused first.
steps=" ctest programs wheel baseline alloc_bench hint migration remap torch_empty preload_overhead trace pytest demo optimizer_step llama host_step disk big sweep zero "
if [[ -n ${GPU_CHECK_ONLY:-} ]]; then  # the steps to run; every other one is skipped
  GPU_CHECK_SKIP=""
  for name in $steps; do [[ " $GPU_CHECK_ONLY " == *" $name "* ]] || GPU_CHECK_SKIP+=" $name"; done
fi
skip=" ${GPU_CHECK_SKIP:-} "
skipped() { [[ $skip == *" $1 "* ]] && echo skipped; }
for name in ${GPU_CHECK_SKIP:-} ${GPU_CHECK_ONLY:-}; do
  if [[ $steps != *" $name "* ]]; then
    echo "GPU_CHECK_SKIP or GPU_CHECK_ONLY names '$name', which is no step of this script; the steps:$steps" >&2
    exit 2
  fi
done
# Each step packs the logs so far: a run stopped midway still returns them.
step() { tar czf "$final/gpu-check-logs.tar.gz" -C "$out" . 2>/dev/null; echo; echo "== $*"; }
failed=()  # the gates that failed, named in the last line
fail() { failed+=("$1"); }
configure() {  # source-dir build-dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix/usr" \
    >"$out/configure-$(basename "$2").log" 2>&1 \
    && ninja -C "$2" -j16 >"$out/build-$(basename "$2").log" 2>&1 \
    || { tail -40 "$out/configure-$(basename "$2").log" "$out/build-$(basename "$2").log"; return 1; }
}
step build
if [[ -n ${GPU_CHECK_PREBUILT:-} ]]; then
  # A build packed elsewhere (scripts/pack-build.sh): its CTest files and binaries name the
  # path it was built at, which is linked to this tree; its shared libraries come along.
  built_at=$(cat "$GPU_CHECK_PREBUILT/source-dir")
  if [[ ! -e $built_at ]]; then mkdir -p "$(dirname "$built_at")" && ln -s "$root" "$built_at"; fi
  [[ $(cd "$built_at" && pwd -P) == $(pwd -P) ]] \
    || { echo "the prebuilt build's path $built_at is another tree here" >&2; exit 1; }
  # Copied once per pack: runs of this script at the same time on one tree (the corpus beside
  # the Python tests, each with its own OUT and steps) share the copy the first one made.
  if ! cmp -s "$GPU_CHECK_PREBUILT/commit" build/.prebuilt-commit 2>/dev/null; then
    rm -rf build && cp -a "$GPU_CHECK_PREBUILT/build" build
    cp "$GPU_CHECK_PREBUILT/commit" build/.prebuilt-commit
  fi
  export LD_LIBRARY_PATH=$root/$GPU_CHECK_PREBUILT/lib:$LD_LIBRARY_PATH
  echo "prebuilt at $(cat "$GPU_CHECK_PREBUILT/commit" | tr '\n' ' ')"
else
  configure . build || exit 1
fi

step "ctest -L gpu (every GPU test, each under a 300 s timeout)"
if [[ -z $(skipped ctest) ]]; then
  (cd build && ctest -L gpu --timeout 300 --output-on-failure -j1 2>&1) >"$out/ctest.log"
  grep -E "^ *[0-9]+/[0-9]+ Test +#" "$out/ctest.log"
  grep -A30 -E "^The following tests FAILED" "$out/ctest.log"
  grep -E "[0-9]+% tests passed" "$out/ctest.log" || echo "ctest did not finish"
  grep -q "^100% tests passed" "$out/ctest.log" || fail ctest
else skipped ctest; fi

step "user programs: each natively and under ZEROALLOC_OFFLOAD=host at a tight limit, outputs compared"
if [[ -z $(skipped programs) ]]; then
  ZEROALLOC_LIBRARY=$root/build/libzeroalloc.so PYTHONUNBUFFERED=1 \
    timeout ${GPU_CHECK_PROGRAMS_TIMEOUT:-1200} python3 tests/programs/run.py ${GPU_CHECK_PROGRAMS:-} \
    >"$out/programs.txt" 2>&1 || fail programs
  # The table; or, where the time limit stopped the run, the verdicts it reached.
  grep -A40 "^program " "$out/programs.txt" || { grep "^done: " "$out/programs.txt"; tail -30 "$out/programs.txt"; }
else skipped programs; fi

step "the wheel: installed with pip, then zeroalloc doctor with no variable set"
if [[ -z $(skipped wheel) ]]; then
wheel=$(ls .whl/zeroalloc-*.whl 2>/dev/null | head -1)
if [[ -z $wheel ]]; then
  CMAKE_PREFIX_PATH="$prefix/usr" python3 -m pip wheel --no-deps --no-build-isolation -w "$out/dist" . \
    >"$out/wheel-build.log" 2>&1 || { tail -20 "$out/wheel-build.log"; fail wheel-build; }
  wheel=$(ls "$out"/dist/zeroalloc-*.whl 2>/dev/null | head -1)
fi
site=/tmp/zeroalloc-site
rm -rf "$site"
if [[ -n $wheel ]] && python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel"; then
  echo "installed $(basename "$wheel")"
  (cd /tmp && env $(env | grep -o '^ZEROALLOC_[A-Z_]*' | sed 's/^/-u /') PYTHONPATH="$site" \
     python3 -m zeroalloc doctor) 2>&1 | tee "$out/doctor.txt" | tail -16
  [[ ${PIPESTATUS[0]} == 0 ]] || fail doctor
  grep -q "$site/zeroalloc/libzeroalloc.so" "$out/doctor.txt" \
    || { echo "doctor did not use the installed library"; fail doctor-library; }
else
  echo "no wheel could be installed"; fail wheel-install
fi
else skipped wheel; fi

step "baseline: the tree in .baseline/ (an earlier commit), built for side-by-side figures"
baseline=""
if [[ -d .baseline && -z $(skipped baseline) ]]; then
  configure .baseline build-baseline && baseline=build-baseline || fail baseline-build
  echo "baseline $(cat .baseline/.commit 2>/dev/null || echo '(commit unknown)'): ${baseline:-failed to build}"
else
  echo skipped
fi

step "caching_allocator_bench (allocation pair), this build${baseline:+ and the baseline}"
if [[ -z $(skipped alloc_bench) ]]; then
  for tree in build $baseline; do
    "$tree/bench/caching_allocator_bench" --benchmark_repetitions=${GPU_CHECK_REPETITIONS:-11} --benchmark_report_aggregates_only=true \
      --benchmark_out="$out/alloc_bench-$tree.json" --benchmark_out_format=json 2>&1 \
      | grep -E "median" | sed "s/^/$tree  /" | tee -a "$out/alloc_bench.txt"
  done
  cp "$out/alloc_bench-build.json" "$out/alloc_bench.json"
else skipped alloc_bench; fi

step "use hints: host time per Llama layer, one call per tensor vs one per layer"
skipped hint || ZEROALLOC_DEVICE=cuda build/bench/hint_bench --benchmark_repetitions=5 \
  --benchmark_report_aggregates_only=true 2>&1 | grep -E "median|Benchmark" | tee "$out/hint_bench.txt"

step "migration throughput: the migrator vs cudaMemcpyAsync"
skipped migration || build/bench/migration_bench --gib 4 --rounds 5 2>&1 | tee "$out/migration.txt" | tail -7

step "what a remap costs, idle and while copies run (Note [What a remap costs])"
skipped remap || build/bench/remap_bench --chunks 16 2>&1 | tee "$out/remap.txt" | tail -12

# Each tree's own bench script and package drive its own library (the C ABI may differ).
step "torch.empty + del through zeroalloc vs native, this build${baseline:+ then the baseline}"
if [[ -z $(skipped torch_empty) ]]; then
  for tree in . ${baseline:+.baseline}; do
    library=$root/build/libzeroalloc.so; [[ $tree == . ]] || library=$root/$baseline/libzeroalloc.so
    echo "-- $tree" | tee -a "$out/torch_empty.txt"
    (cd "$tree" && python3 bench/python/torch_empty_bench.py --rounds ${GPU_CHECK_ROUNDS:-4} --library "$library" 2>&1) \
      | tee -a "$out/torch_empty.txt" | grep -v '^{' | tail -6
  done
else skipped torch_empty; fi

step "training step time with libzeroalloc.so preloaded vs without, this build${baseline:+ then the baseline}"
if [[ -z $(skipped preload_overhead) ]]; then
  for tree in . ${baseline:+.baseline}; do
    library=$root/build/libzeroalloc.so; [[ $tree == . ]] || library=$root/$baseline/libzeroalloc.so
    echo "-- $tree" >>"$out/preload_overhead.txt"
    (cd "$tree" && python3 bench/python/preload_overhead_bench.py --library "$library" --steps ${GPU_CHECK_STEPS:-200} --rounds ${GPU_CHECK_ROUNDS:-3} 2>&1) \
      | tee -a "$out/preload_overhead.txt" | grep "^step time" | sed "s|^|$tree  |"
  done
else skipped preload_overhead; fi

step "training trace: zeroalloc vs PyTorch native, same trace"
if [[ -z $(skipped trace) ]]; then
  build/demo/zeroalloc-demo --emit-trace "$out/trace.txt" >/dev/null
  build/demo/zeroalloc-demo --trace "$out/trace.txt" 2>&1 | tee "$out/demo.txt" | tail -12
  python3 bench/python/replay_trace_torch.py "$out/trace.txt" 2>&1 | tee "$out/replay_native.txt" | tail -1
  python3 bench/python/replay_trace_torch.py --expandable "$out/trace.txt" 2>&1 | tee "$out/replay_expandable.txt" | tail -1
else skipped trace; fi

step "Python: package, zeroalloc.torch, PyTorch training with losses bit for bit"
if [[ -z $(skipped pytest) ]] && { ((${GPU_CHECK_PYTEST_JOBS:-1} > 1)) || [[ -n ${GPU_CHECK_PYTEST_PART:-} ]]; }; then
  # The tests chosen, dealt in turn to GPU_CHECK_PYTEST_JOBS pytest processes run at once:
  # each test trains in processes of its own, and the device has room for several.
  chosen=(${GPU_CHECK_PYTEST:-tests/python} ${GPU_CHECK_PYTEST_K:+-k "$GPU_CHECK_PYTEST_K"})
  ZEROALLOC_LIBRARY=$PWD/build/libzeroalloc.so python3 -m pytest -q --collect-only "${chosen[@]}" \
    2>&1 | grep "::" >"$out/pytest-ids.txt"
  if [[ -n ${GPU_CHECK_PYTEST_PART:-} ]]; then
    if [[ ! $GPU_CHECK_PYTEST_PART =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] ||
       ((BASH_REMATCH[1] > BASH_REMATCH[2])); then
      echo "GPU_CHECK_PYTEST_PART=$GPU_CHECK_PYTEST_PART: give K/N with 1 <= K <= N (say 1/2)" >&2
      exit 2
    fi
    awk -v part="${BASH_REMATCH[1]}" -v parts="${BASH_REMATCH[2]}" '(NR - 1) % parts == part - 1' \
      "$out/pytest-ids.txt" >"$out/pytest-part.txt"
    echo "part $GPU_CHECK_PYTEST_PART: $(wc -l <"$out/pytest-part.txt") of $(wc -l <"$out/pytest-ids.txt") tests"
    mv "$out/pytest-part.txt" "$out/pytest-ids.txt"
  fi
  jobs=${GPU_CHECK_PYTEST_JOBS:-1}
  for ((shard = 0; shard < jobs; ++shard)); do
    mapfile -t ids < <(awk -v jobs="$jobs" -v shard="$shard" 'NR % jobs == shard' "$out/pytest-ids.txt")
    ((${#ids[@]})) || continue
    (ZEROALLOC_LIBRARY=$PWD/build/libzeroalloc.so timeout ${GPU_CHECK_PYTEST_TIMEOUT:-540} \
      python3 -m pytest -q -s -rfEs --durations=6 "${ids[@]}" >"$out/pytest-$shard.log" 2>&1
     echo $? >"$out/pytest-$shard.rc") &
  done
  wait
  python3 - "$out" "$jobs" <<'PY' >"$out/pytest.log"
import pathlib, re, sys
out, jobs = pathlib.Path(sys.argv[1]), int(sys.argv[2])
counts, longest, codes = {}, 0.0, []
for log in sorted(out.glob("pytest-[0-9]*.log")):
    text = log.read_text()
    print(f"== {log.name}\n{text}")
    codes.append(int((out / log.name.replace(".log", ".rc")).read_text()))
    last = re.findall(r"^=* ?(\d+ (?:passed|failed|skipped|error).*) in ([0-9.]+)s", text, re.M)
    if last:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last[-1][0]):
            counts[word] = counts.get(word, 0) + int(number)
        longest = max(longest, float(last[-1][1]))
    else:  # stopped (a timeout): what pytest's progress marks say ran before it (about:
        # a line of a test's own output may start with one of them)
        marks = "".join(re.findall(r"^([.sFExX]+)", text, re.M))
        for mark, word in ((".", "passed"), ("F", "failed"), ("E", "errors"), ("s", "skipped"),
                           ("x", "xfailed"), ("X", "xpassed")):
            counts[f"{word} before a stop"] = (counts.get(f"{word} before a stop", 0) +
                                               marks.count(mark))
words = ", ".join(f"{number} {word}" for word, number in counts.items() if number) or "0 passed"
print(f"{words} in {longest:.2f}s ({jobs} jobs at once; exit codes {codes})")
PY
  grep -q "exit codes \[0\(, 0\)*\])" "$out/pytest.log" || fail pytest  # none ran: failed
  grep -E "^(FAILED|ERROR) " "$out/pytest.log"
  tail -1 "$out/pytest.log"
  echo "-- figures printed by the Python tests"
  grep -E "^(every-step offload|Trainer under|ZEROALLOC_TORCH=zeroalloc|expandable_segments=|  cuMemCreate passed)" \
    "$out/pytest.log" || true
elif [[ -z $(skipped pytest) ]]; then
  ZEROALLOC_LIBRARY=$PWD/build/libzeroalloc.so timeout ${GPU_CHECK_PYTEST_TIMEOUT:-540} python3 -m pytest -q -s -rs --durations=12 \
    ${GPU_CHECK_PYTEST:-tests/python} ${GPU_CHECK_PYTEST_K:+-k "$GPU_CHECK_PYTEST_K"} \
    >"$out/pytest.log" 2>&1 || fail pytest
  tail -22 "$out/pytest.log"
  echo "-- figures printed by the Python tests"
  grep -E "^(every-step offload|Trainer under|ZEROALLOC_TORCH=zeroalloc|expandable_segments=|  cuMemCreate passed)" \
    "$out/pytest.log" || true
else skipped pytest; fi

step "demo: a Llama-style model trained under a limit through offload, against the whole device"
skipped demo || { python3 demo/train_offload.py --library build/libzeroalloc.so \
  --report "$out/train" 2>&1 | tee "$out/demo_train.txt" | tail -4; [[ ${PIPESTATUS[0]} == 0 ]] || fail demo; }

step "optimizer step placement: device, in place, bounce, zt.offload's step, migrate, CPU Adam"
skipped optimizer_step || python3 bench/python/optimizer_step_bench.py \
  --library build/libzeroalloc.so 2>&1 | tee "$out/optimizer_step.txt" | tail -13

step "Llama 1.3B: native, zeroalloc, offload under a limit, FSDP2 with CPUOffloadPolicy"
skipped llama || python3 bench/python/offload_llama_bench.py \
  --library build/libzeroalloc.so --warmup 8 --steps 8 --overlap-bytes 0,2147483648 --log-dir "$out/llama" 2>&1 | tee "$out/llama.txt" | grep -v '^{' | tail -6

step "the host step's AdamW on this machine's CPUs, by thread count (Note [Stepped on the host])"
# Both forms of the step: fp32 gradients, and master weights (bf16 gradient and copy), each
# beside the same bytes with no arithmetic (how near the step runs to the memory's bound).
skipped host_step || for form in "" --masters; do
  build/bench/host_step_bench --millions 256 --rounds 3 $form 2>&1 | tee -a "$out/host_step.txt" | tail -7
done

step "the NVMe tier's disk store against plain O_DIRECT I/O on this machine's disk"
if [[ -z $(skipped disk) ]]; then
  mkdir -p /tmp/zeroalloc-disk
  build/bench/disk_store_bench --path /tmp/zeroalloc-disk --chunks ${GPU_CHECK_DISK_CHUNKS:-32} --rounds 2 \
    2>&1 | tee "$out/disk.txt" | tail -8
  # dd itself, O_DIRECT, 16 MiB blocks, as many bytes as the bench moved per round.
  blocks=$(( ${GPU_CHECK_DISK_CHUNKS:-32} * 4 ))
  dd if=/dev/zero of=/tmp/zeroalloc-disk/dd bs=16M count=$blocks oflag=direct 2>&1 | tail -1 | sed 's/^/dd write: /' | tee -a "$out/disk.txt"
  dd if=/tmp/zeroalloc-disk/dd of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | sed 's/^/dd read:  /' | tee -a "$out/disk.txt"
  rm -f /tmp/zeroalloc-disk/dd
  # The same while PCIe copies run both ways (the migration bench in the background).
  build/bench/migration_bench --gib 4 --rounds 200 >/dev/null 2>&1 & copies=$!
  sleep 2
  echo "-- while PCIe copies run" | tee -a "$out/disk.txt"
  build/bench/disk_store_bench --path /tmp/zeroalloc-disk --chunks ${GPU_CHECK_DISK_CHUNKS:-32} --rounds 2 \
    2>&1 | tee -a "$out/disk.txt" | tail -3
  kill $copies 2>/dev/null; wait $copies 2>/dev/null
  rm -rf /tmp/zeroalloc-disk
else skipped disk; fi

# The largest model: a 16.2B Llama (fp32 weights, AdamW) across device (130 GiB), host
# (96 GiB) and disk (40 GiB); one timed step after one warm-up, about 4 minutes.
step "the NVMe tier: a 16B model across device, host and disk"
if [[ -z $(skipped big) ]]; then
  mkdir -p /tmp/zeroalloc-nvme
  env ZEROALLOC_LIBRARY=$root/build/libzeroalloc.so ZEROALLOC_DEVICE=cuda ZEROALLOC_LOG_LEVEL=warn \
    ZEROALLOC_OFFLOAD=host ZEROALLOC_HOST_LIMIT=96GiB ZEROALLOC_MEMORY_LIMIT=$((130 << 30)) \
    ZEROALLOC_NVME_PATH=/tmp/zeroalloc-nvme ZEROALLOC_NVME_SIZE=40GiB ZEROALLOC_ACCESS=hinted \
    PYTHONUNBUFFERED=1 \
    timeout ${GPU_CHECK_BIG_TIMEOUT:-330} python3 bench/python/offload_llama_bench.py --worker offload \
    --warmup 1 --steps 1 --hidden 5120 --intermediate 13824 --layers ${GPU_CHECK_BIG_LAYERS:-50} \
    --heads 40 --accumulate 4 --checkpointing --no-autocast-cache >"$out/big.out" 2>"$out/big.err"
  echo "exit $?"
  grep -o '^step [0-9]*: [0-9.]* s (fwd/bwd/step [0-9./]*' "$out/big.err"
  python3 - "$out/big.out" <<'PY' | tee "$out/big.txt"
import json, sys
text = open(sys.argv[1]).read()
result = json.loads(text[text.index("{"):]) if "{" in text else {}
timed, offload = result.get("timed") or {}, result.get("offload") or {}
steps = max(1, timed.get("steps", 1))
print(f'parameters {result.get("parameters", 0) / 1e9:.2f}B; step {result.get("step_s", 0):.1f} s; '
      f'{result.get("model_tflops", 0):.1f} model TFLOPS; on disk {offload.get("disk_resident_bytes", 0) / 2**30:.1f} GiB; '
      f'per timed step: read {timed.get("bytes_from_disk", 0) / steps / 1e9:.1f} GB, '
      f'wrote {timed.get("bytes_to_disk", 0) / steps / 1e9:.1f} GB, disk time {timed.get("disk_ns", 0) / steps / 1e9:.1f} s, '
      f'{timed.get("disk_prefetches", 0) // steps} chunks read ahead')
PY
  rm -rf /tmp/zeroalloc-nvme
else skipped big; fi

# Needs DeepSpeed's sdist and wheels in .whl/ds/ (docs/building.md, "Benchmarks beside DeepSpeed"): without them the
# sweep runs zeroalloc's rows alone.
step "budget sweep: Llama 1.3B under memory limits, beside DeepSpeed ZeRO-Offload, one run"
if [[ -z $(skipped sweep) ]]; then
  sweep_modes=native,offload
  if [[ -d .whl/ds ]] && bash scripts/install-deepspeed.sh /tmp/deepspeed-site >"$out/deepspeed-install.log" 2>&1; then
    export PYTHONPATH=/tmp/deepspeed-site${PYTHONPATH:+:$PYTHONPATH} PATH=$PATH:/tmp/deepspeed-site/bin
    sweep_modes=${GPU_CHECK_SWEEP_MODES:-native,offload,ds2,ds3}
  else
    echo "DeepSpeed not installed (.whl/ds missing or install failed: deepspeed-install.log); zeroalloc rows only"
    tail -5 "$out/deepspeed-install.log" 2>/dev/null
    # The modes asked for, less DeepSpeed's (a model native cannot hold names offload alone).
    if [[ -n ${GPU_CHECK_SWEEP_MODES:-} ]]; then
      sweep_modes=$(tr , '\n' <<<"$GPU_CHECK_SWEEP_MODES" | grep -v '^ds' | paste -sd,)
    fi
  fi
  PYTHONUNBUFFERED=1 python3 bench/python/offload_llama_bench.py --library build/libzeroalloc.so \
    --modes "$sweep_modes" --limits-gib "${GPU_CHECK_SWEEP_LIMITS:-ds2,18,21,24.8}" \
    --warmup ${GPU_CHECK_SWEEP_WARMUP:-4} --steps ${GPU_CHECK_SWEEP_STEPS:-5} ${GPU_CHECK_SWEEP_ARGS:-} \
    --log-dir "$out/sweep" 2>&1 | tee "$out/sweep.txt" | grep -v '^{' | tail -30
else skipped sweep; fi

# ZeRO across the host's GPUs (bench/python/zero_bench.py): zeroalloc's stages beside DDP,
# FSDP2 and DeepSpeed ZeRO-3; only where there are two GPUs or more.
step "ZeRO across GPUs: stages 1-3 beside DDP, FSDP2 and DeepSpeed ZeRO-3, one run"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ -z $(skipped zero) ]] && ((gpus >= 2)); then
  zero_modes=${GPU_CHECK_ZERO_MODES:-ddp,zero1,zero2,zero3,fsdp2}
  if [[ -d .whl/ds ]] && bash scripts/install-deepspeed.sh /tmp/deepspeed-site >"$out/deepspeed-install-zero.log" 2>&1; then
    export PYTHONPATH=/tmp/deepspeed-site${PYTHONPATH:+:$PYTHONPATH} PATH=$PATH:/tmp/deepspeed-site/bin
    zero_modes=${GPU_CHECK_ZERO_MODES:-ddp,zero1,zero2,zero3,fsdp2,ds3}
  fi
  PYTHONUNBUFFERED=1 python3 bench/python/zero_bench.py --nproc "$gpus" --modes "$zero_modes" \
    --library build/libzeroalloc.so ${GPU_CHECK_ZERO_ARGS:-} 2>&1 | tee "$out/zero.txt" | grep -v '^{' | tail -12
elif [[ -n $(skipped zero) ]]; then skipped zero
else echo "one GPU: nothing to partition across (nvidia-h200-x2 runs it)"; fi

step summary
python3 - "$out" <<'PY'
import json, os, re, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = []
left_out = set(os.environ.get("GPU_CHECK_SKIP", "").split())


def missing(step, detail=""):  # a figure a step left out is "skipped", not "missing"
    return "skipped" if step in left_out else "missing" + (f" ({detail})" if detail else "")


try:
    bench = json.loads((out / "alloc_bench.json").read_text())
    baseline_file = out / "alloc_bench-build-baseline.json"
    baseline = {b["run_name"]: b for b in json.loads(baseline_file.read_text())["benchmarks"]
                if b.get("aggregate_name") == "median"} if baseline_file.exists() else {}
    for b in bench["benchmarks"]:
        if b.get("aggregate_name") == "median":
            old = baseline.get(b["run_name"])
            rows.append((b["run_name"], f'{b["real_time"]:.1f} {b["time_unit"]}' +
                         (f' (baseline {old["real_time"]:.1f})' if old else "")))
except Exception as e:
    rows.append(("alloc bench", missing("alloc_bench", e)))
demo = (out / "demo.txt").read_text() if (out / "demo.txt").exists() else ""
m = re.search(r"peak reserved / peak allocated = ([0-9.]+)", demo)
rows.append(("trace ratio zeroalloc", m.group(1) if m else missing("demo")))
for name in ("replay_native", "replay_expandable"):
    try:
        line = (out / f"{name}.txt").read_text().strip().splitlines()[-1]
        rows.append((f"trace ratio {name}", f'{json.loads(line)["ratio"]:.3f}'))
    except Exception as e:
        rows.append((f"trace ratio {name}", missing("trace", e)))
tree = "."
for line in (out / "torch_empty.txt").read_text().splitlines() if (out / "torch_empty.txt").exists() else []:
    if line.startswith("-- "):
        tree = line[3:]
    if re.match(r"^\s*[0-9.]+ [KMG]?i?B ", line):
        rows.append((f"torch.empty+del {tree}", line.strip()))
tree = "."
for line in (out / "preload_overhead.txt").read_text().splitlines() if (out / "preload_overhead.txt").exists() else []:
    if line.startswith("-- "):
        tree = line[3:]
    if line.startswith("step time:"):
        rows.append((f"preload overhead {tree}", line[len("step time: "):]))
for line in (out / "migration.txt").read_text().splitlines() if (out / "migration.txt").exists() else []:
    if re.match(r"^(device -> host|host -> device|both at once)", line):
        rows.append(("migration GB/s (ours, memcpy, ratio)", line.strip()))
for line in (out / "optimizer_step.txt").read_text().splitlines() if (out / "optimizer_step.txt").exists() else []:
    if re.match(r"^(device|in_place|bounce|shipped|migrate|host_adam)_", line):
        rows.append(("AdamW step s (vs device)", line.strip()))
for line in (out / "llama.txt").read_text().splitlines() if (out / "llama.txt").exists() else []:
    if re.match(r"^(native|zeroalloc|offload\S*|fsdp2) ", line):
        rows.append(("Llama 1.3B step s, tokens/s, vs native, vs fsdp2", line.strip()[:90]))
for line in (out / "disk.txt").read_text().splitlines() if (out / "disk.txt").exists() else []:
    if re.match(r"^\| [0-9]+ \|", line):
        rows.append(("disk GB/s: write store/plain/ratio, read store/plain/ratio", line.strip()))
for line in (out / "big.txt").read_text().splitlines() if (out / "big.txt").exists() else []:
    if line.startswith("parameters "):
        rows.append(("the NVMe tier: the big model", line.strip()))
ctest = (out / "ctest.log").read_text() if (out / "ctest.log").exists() else ""
m = re.search(r"(\d+% tests passed.*)", ctest)
rows.append(("ctest -L gpu", m.group(1) if m else missing("ctest")))
doctor = (out / "doctor.txt").read_text() if (out / "doctor.txt").exists() else ""
m = re.search(r"(\d+ checks: .*)", doctor)
rows.append(("doctor after pip install", m.group(1) if m else "missing"))
py = (out / "pytest.log").read_text() if (out / "pytest.log").exists() else ""
m = re.findall(r"(\d+ (?:passed|failed|skipped)[^\n]*)", py)
rows.append((f"pytest {os.environ.get('GPU_CHECK_PYTEST', 'tests/python')}",
             m[-1] if m else missing("pytest")))
w = max(len(r[0]) for r in rows)
for k, v in rows:
    print(f"{k:<{w}}  {v}")
sweep = (out / "sweep.txt").read_text() if (out / "sweep.txt").exists() else ""
if "budget sweep" in sweep:
    print(sweep[sweep.index("budget sweep"):].split("\n{")[0].rstrip())
PY
if ((${#failed[@]})); then echo "status: FAIL (${failed[*]})"; exit 1; fi
echo "status: PASS"
