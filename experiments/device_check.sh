#!/usr/bin/env bash
# One short GPU loan, as much information as it can give. Stages, each under its own time limit and
# each run even when an earlier one failed:
#   install  the ml-collections wheels carried in .whl/ into a temp dir on PYTHONPATH (no network)
#   env      $OUT/env.txt: date, nvidia-smi, python / jax versions, devices, revision, a trivial
#            Triton-lowered Pallas kernel (does Pallas-on-Triton work here at all?), tree hash
#   engine   experiments.engine_bench :gpu  -> $OUT/engine_bench_gpu.json (host ms per decode step
#            at 256 then 64 running; the cheap, likely-to-succeed measurement goes first)
#            and the same with the overlapped step off (engine_bench times both in every round)
#   decode   experiments.kernel_bench :h200, decode only -> $OUT/kernel_bench_h200_decode.json
#            (B=64 ctx 4096 bf16: read-only roofline, copy, pallas_gpu at the config's 4 splits and
#            at the heuristic's choice, jax_gpu, the unmasked fallback, xla)
#   grid     experiments.kernel_bench :h200, decode_grid only -> $OUT/kernel_bench_h200_grid.json
#            (bf16 + fp32 x context 1k/4k/16k x B 1/8/64/256: pallas_gpu with the heuristic's
#            splits vs jax_gpu on the same arrays, read / copy roofline per point)
#   ragged   experiments.kernel_bench :h200, ragged only -> $OUT/kernel_bench_h200_ragged.json
#            (one process per stage: a hung Triton compile in one op does not eat another's time)
#   kvdtype  experiments.kernel_bench :h200, decode on bf16 / int8 / fp8_e4m3 pools (B=64 ctx 4096,
#            page scales) -> $OUT/kernel_bench_h200_kvdtype.json: per KV dtype, pallas_gpu and xla
#            time, bytes at the dtype's own count (values + f32 scales + q + out) and the fraction
#            of the read-only roofline measured on that dtype's own pool. NOT in the default
#            STAGES (it would push the worst case past a 10-minute command); run it on its own:
#              STAGES="install env kvdtype" GIT_REV=<sha> bash experiments/device_check.sh
#            (~1-2 min estimated, never yet run on a GPU)
#   cascade  (opt-in: add it to STAGES) experiments.cascade :h200 -> $OUT/cascade_h200.json
#            (cascade vs ordinary paged decode, compiled GPU-style Pallas, bf16, groups 1-64 x
#            prefix 256-8k; its JSON is rewritten after each point). Never run on a device yet;
#            selecting it adds one file under $OUT and up to T_CASCADE (150 s) to the worst case.
#   sparse   (opt-in: add it to STAGES) experiments.sparse_decode :h200 -> $OUT/sparse_decode_h200.json
#            (Quest selected-page decode vs dense, compiled GPU-style Pallas, bf16, Hq=32 Hkv=8
#            D=128, B=8 at 4k and 32k, budget 1/8: bytes counted, time, and each side's bytes /
#            time as a fraction of the device's own streaming-read rate, measured in the same
#            rounds; the selected pages through the decode kernel and through the ragged one).
#            Never run on a device yet; up to T_SPARSE (150 s). CPU dry run (10 s here on
#            2026-12-06 with both kernels; smoke shapes, its numbers mean nothing):
#              STAGES=sparse DEVICE_CHECK_SMOKE=1 OUT=/tmp/sd PYTHON=.venv/bin/python \
#                bash experiments/device_check.sh
#   simval   (opt-in: add it to STAGES) experiments.sim_gpu_check -> $OUT/sim_gpu_check.json: the
#            real engine serves 60 s of the Azure conversation trace (minutes 20-21, real arrival
#            times; random weights of a ~1B Llama shape, bf16 KV) on this GPU, then paged.sim runs
#            the same requests with RooflineStepModel at H200 figures (what every simulated result
#            uses) and with this device's measured copy bandwidth; p50/p99 TTFT and TPOT side by
#            side with relative errors. Never run on a device yet (estimate: ~1 min of serving plus
#            compiles); up to T_SIMVAL (300 s). CPU dry run (29 s here on 2026-12-06; its numbers
#            mean nothing: a CPU engine against H200 figures):
#              STAGES=simval DEVICE_CHECK_SMOKE=1 OUT=/tmp/sv PYTHON=.venv/bin/python \
#                bash experiments/device_check.sh
#   summary  key numbers and every error's head to stdout and $OUT/summary.txt
# Both benches write their JSON as they go, so a stage stopped by its limit still leaves results.
# Outputs: at most 10 files directly under $OUT (env.txt, engine_bench.log, kernel_bench.log, six
# JSONs, summary.txt); logs over 15 MiB are cut to their first and last 7 MiB.
#
# On the device (repo root, .whl carried; .git does not travel, so pass the revision):
#   GIT_REV=<sha> bash experiments/device_check.sh
# CPU dry run (smoke variants, JAX_PLATFORMS=cpu, about a minute here):
#   DEVICE_CHECK_SMOKE=1 OUT=/tmp/devout PYTHON=.venv/bin/python bash experiments/device_check.sh
# Knobs (env): OUT (default: a new temp dir), PYTHON (python3), GIT_REV, STAGES (default
# "install env engine decode grid ragged"; kvdtype and cascade on request; summary always runs,
# install too while ml_collections is missing), T_INSTALL T_ENV T_ENGINE T_DECODE T_GRID
# T_RAGGED T_KVDTYPE T_CASCADE (seconds), EB_FLAGS / KB_FLAGS (extra flags for the benches, word-split, e.g.
# KB_FLAGS="--config.repeats=5"), DEVICE_CHECK_SMOKE=1.
#
# Worst case 20 + 30 + 120 + 90 + 120 + 80 + 15 (summary) = 475 s, 535 s if every stage also used
# its 10 s kill grace: under 9 minutes, so a 15-minute loan has room for a start and a rerun.
# Seen on an H200 (2026-11-30): install/env ~8 s, engine 32-36 s (steady, overlap not yet timed
# on and off; expected ~50 s now), decode ~29 s (+ ~5 s now: the read roofline and one more
# kernel variant), ragged ~50 s. Grid: estimated ~100 s (24 points, ~4 s of compiles each); its
# JSON is rewritten after each point, bf16 first, so a cut keeps the finished points.
set -u

cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d /tmp/device_check_out.XXXXXX)
fi
mkdir -p "$OUT"
export OUT
export PYTHONUNBUFFERED=1
export JAX_TRACEBACK_FILTERING=${JAX_TRACEBACK_FILTERING:-off}  # lowering frames in tracebacks
SMOKE=${DEVICE_CHECK_SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  export EXPERIMENTS_ALLOW_DIRTY=1  # a dry run of a working tree: its JSONs are no results
  SV_VARIANT=smoke
  KB_VARIANT=smoke
  EB_VARIANT=smoke
  KV_IMPLS="('interpret_gpu', 'xla')"
else
  SV_VARIANT=default
  KB_VARIANT=h200
  EB_VARIANT=gpu
  KV_IMPLS="('pallas_gpu', 'xla')"
fi
T_INSTALL=${T_INSTALL:-20}
T_ENV=${T_ENV:-30}
T_ENGINE=${T_ENGINE:-120}
T_DECODE=${T_DECODE:-90}
T_GRID=${T_GRID:-120}
T_RAGGED=${T_RAGGED:-80}
T_KVDTYPE=${T_KVDTYPE:-120}
T_CASCADE=${T_CASCADE:-150}
T_SIMVAL=${T_SIMVAL:-300}
T_SPARSE=${T_SPARSE:-150}
STAGES=${STAGES:-install env engine decode grid ragged}
EB_FLAGS=${EB_FLAGS:-}
KB_FLAGS=${KB_FLAGS:-}
SITE=$(mktemp -d /tmp/device_check_site.XXXXXX)
export SITE SMOKE PYTHON
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
STATUS=""
T_START=$SECONDS

want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# run_stage NAME LIMIT LOG RESULT CMD...: appends the command's output to LOG, notes rc and
# seconds; keeps the end of LOG for the summary when the stage timed out or failed without RESULT
# (kernel_bench exits 1 when an implementation failed, which its JSON shows better).
run_stage() {
  local name=$1 limit=$2 log=$3 result=$4
  shift 4
  local t0=$SECONDS rc note=""
  echo "=== [$(date -u +%T) +$((SECONDS - T_START))s] $name: start (limit ${limit}s)" | tee -a "$log"
  if [ "$1" = bash ]; then echo "    (shell function of this script)" >>"$log"; else echo "    $*" >>"$log"; fi
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in 124 | 137) note=" TIMED OUT" ;; esac
  if [ $rc != 0 ] && ! { [ $rc = 1 ] && [ -f "$result" ]; }; then
    { echo "--- $name rc=$rc$note: last lines of $(basename "$log")"; tail -n 15 "$log" | cut -c1-300; } \
      >>"$SITE/tails.txt"
  fi
  echo "=== [$(date -u +%T) +$((SECONDS - T_START))s] $name: rc=$rc after $((SECONDS - t0))s$note" \
    | tee -a "$log"
  STATUS="$STATUS $name:rc=$rc:$((SECONDS - t0))s$note"
}

install_wheels() {
  local w found=0
  for w in .whl/*.whl; do
    [ -e "$w" ] || continue
    found=1
    case "$(basename "$w")" in
      pyyaml-* | PyYAML-*)  # binary (cp312): only where the image lacks yaml
        if "$PYTHON" -c "import yaml" 2>/dev/null; then echo "yaml present: skip $w"; continue; fi ;;
    esac
    echo "installing $w"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$w" || {
      echo "pip failed for $w; unpacking the wheel (a zip) instead"
      "$PYTHON" -m zipfile -e "$w" "$SITE"
    }
  done
  [ $found = 1 ] || echo "no wheels under .whl/ (carry .whl); relying on the image"
  "$PYTHON" -c "import ml_collections, yaml, absl; print('ml_collections', ml_collections.__file__)"
}

env_facts() {
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  nproc: $(nproc)"
  echo "revision: $(git rev-parse HEAD 2>/dev/null || echo "no git; GIT_REV=${GIT_REV:-unset}")"
  echo "smoke=$SMOKE PYTHON=$PYTHON PYTHONPATH=$PYTHONPATH JAX_PLATFORMS=${JAX_PLATFORMS:-}"
  echo "XLA_FLAGS=${XLA_FLAGS:-} XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-}"
  free -g 2>/dev/null | head -2
  echo "--- nvidia-smi"
  timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi unavailable"
  echo "--- python"
  "$PYTHON" -VV
  "$PYTHON" -m pip list 2>/dev/null \
    | grep -iE '^(jax|jaxlib|jax-cuda|flax|optax|numpy|ml.collections|ml.dtypes|pyyaml|absl|triton|nvidia-(cuda|cudnn|nccl)|six)' \
    || true
  echo "--- jax"
  "$PYTHON" - <<'EOF'
import importlib, time, traceback
import jax, jax.numpy as jnp
import jaxlib
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "backend", jax.default_backend())
print("devices", jax.devices())
d = jax.devices()[0]
print("device_kind", getattr(d, "device_kind", "?"))
try:
    stats = d.memory_stats() or {}
    print("memory bytes_limit", stats.get("bytes_limit"), "in use", stats.get("bytes_in_use"))
except Exception as e:  # noqa: BLE001
    print("memory_stats:", type(e).__name__, e)
print("jax_pallas_use_mosaic_gpu", getattr(jax.config, "jax_pallas_use_mosaic_gpu", "?"))
for mod in ("jax.experimental.pallas.triton", "jax.experimental.pallas.mosaic_gpu",
            "jax.experimental.pallas.ops.gpu.paged_attention", "ml_collections"):
    try:
        m = importlib.import_module(mod)
        extra = ""
        if mod.endswith("triton"):
            extra = f" CompilerParams={hasattr(m, 'CompilerParams')} load={hasattr(m, 'load')}"
        print("import ok:", mod + extra)
    except Exception as e:  # noqa: BLE001
        print("import FAILED:", mod, type(e).__name__, str(e)[:300])
x = jnp.ones((4096, 4096), jnp.bfloat16)
t = time.perf_counter(); (x @ x).block_until_ready(); print(f"first matmul {time.perf_counter() - t:.2f}s")
try:  # the smallest Triton-lowered Pallas kernel: does the lowering work here at all?
    from jax.experimental import pallas as pl
    from pallas_kernels import compat
    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0
    params = compat.gpu_compiler_params(num_warps=4, num_stages=2)
    print("triton compiler params:", type(params).__name__)
    y = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                       compiler_params=params,
                       interpret=jax.default_backend() == "cpu")(jnp.zeros((16, 128), jnp.float32))
    print("trivial Triton pallas_call ok:", bool((y == 1).all()))
except Exception:  # noqa: BLE001
    print("trivial Triton pallas_call FAILED:\n" + traceback.format_exc()[-3000:])
EOF
  echo "--- source tree (sha256 of every .py / .sh / .npz / .json under the package dirs)"
  find paged pallas_kernels experiments tests -type f \( -name '*.py' -o -name '*.sh' -o -name '*.npz' -o -name '*.json' \) \
    -not -path '*/results/*' -not -path '*/__pycache__/*' -print0 2>/dev/null \
    | LC_ALL=C sort -z | xargs -0 sha256sum >"$SITE/tree.sha256"
  echo "tree sha256: $(sha256sum <"$SITE/tree.sha256" | cut -d' ' -f1) ($(wc -l <"$SITE/tree.sha256") files)"
  cat "$SITE/tree.sha256"
}

ENV_TXT="$OUT/env.txt"
EB_LOG="$OUT/engine_bench.log"
KB_LOG="$OUT/kernel_bench.log"
EB_JSON="$OUT/engine_bench_$EB_VARIANT.json"
KB_DECODE="$OUT/kernel_bench_${KB_VARIANT}_decode.json"
KB_RAGGED="$OUT/kernel_bench_${KB_VARIANT}_ragged.json"
KB_GRID="$OUT/kernel_bench_${KB_VARIANT}_grid.json"
KB_KV="$OUT/kernel_bench_${KB_VARIANT}_kvdtype.json"
CAS_JSON="$OUT/cascade_${KB_VARIANT}.json"
SD_JSON="$OUT/sparse_decode_${KB_VARIANT}.json"
echo "device_check: OUT=$OUT smoke=$SMOKE stages=[$STAGES] GIT_REV=${GIT_REV:-unset}"
# .git does not travel: the results writer (experiments/provenance.py) takes the commit from
# GIT_REV and records the source tree's sha256 beside it; without GIT_REV it would refuse to write.
if [ -z "${GIT_REV:-}" ] && ! git rev-parse HEAD >/dev/null 2>&1; then
  echo "device_check: WARNING no .git and no GIT_REV: results are written with --allow_dirty semantics"
  export EXPERIMENTS_ALLOW_DIRTY=1
fi
SV_JSON="$OUT/sim_gpu_check.json"

if want install || ! "$PYTHON" -c "import ml_collections" 2>/dev/null; then  # the benches need it
  run_stage install "$T_INSTALL" "$ENV_TXT" - bash -c "$(declare -f install_wheels); install_wheels"
fi
if want env; then
  run_stage env "$T_ENV" "$ENV_TXT" - bash -c "$(declare -f env_facts); env_facts"
fi
if want engine; then
  # shellcheck disable=SC2086  # EB_FLAGS is a word list on purpose
  # engine_bench writes engine_bench.json into its output_dir; it is copied to $EB_JSON.
  run_stage engine "$T_ENGINE" "$EB_LOG" - "$PYTHON" -m experiments.engine_bench \
    "--config=experiments/configs/engine_bench.py:$EB_VARIANT" "--config.output_dir=$SITE/engine_bench" \
    $EB_FLAGS
  [ -f "$SITE/engine_bench/engine_bench.json" ] && cp "$SITE/engine_bench/engine_bench.json" "$EB_JSON"
fi
if want decode; then
  # shellcheck disable=SC2086
  run_stage decode "$T_DECODE" "$KB_LOG" "$KB_DECODE" "$PYTHON" -m experiments.kernel_bench \
    "--config=experiments/configs/kernel_bench.py:$KB_VARIANT" "--config.ops=('decode',)" \
    "--out=$KB_DECODE" $KB_FLAGS
fi
if want grid; then
  # shellcheck disable=SC2086
  run_stage grid "$T_GRID" "$KB_LOG" "$KB_GRID" "$PYTHON" -m experiments.kernel_bench \
    "--config=experiments/configs/kernel_bench.py:$KB_VARIANT" "--config.ops=('decode_grid',)" \
    "--out=$KB_GRID" $KB_FLAGS
fi
if want ragged; then
  # shellcheck disable=SC2086
  run_stage ragged "$T_RAGGED" "$KB_LOG" "$KB_RAGGED" "$PYTHON" -m experiments.kernel_bench \
    "--config=experiments/configs/kernel_bench.py:$KB_VARIANT" "--config.ops=('ragged',)" \
    "--out=$KB_RAGGED" $KB_FLAGS
fi
if want cascade; then
  # cascade writes cascade.json into its output_dir (after every point); copied to $CAS_JSON.
  run_stage cascade "$T_CASCADE" "$KB_LOG" - "$PYTHON" -m experiments.cascade \
    "--config=experiments/configs/cascade.py:$KB_VARIANT" "--config.output_dir=$SITE/cascade"
  [ -f "$SITE/cascade/cascade.json" ] && cp "$SITE/cascade/cascade.json" "$CAS_JSON"
fi
if want sparse; then
  # sparse_decode writes sparse_decode.json into its output_dir (after every point).
  run_stage sparse "$T_SPARSE" "$KB_LOG" - "$PYTHON" -m experiments.sparse_decode \
    "--config=experiments/configs/sparse_decode.py:$KB_VARIANT" "--config.output_dir=$SITE/sparse_decode"
  if [ -f "$SITE/sparse_decode/sparse_decode.json" ]; then
    cp "$SITE/sparse_decode/sparse_decode.json" "$SD_JSON"
    timeout 15 "$PYTHON" - "$SD_JSON" >"$SITE/sparse_summary.txt" 2>&1 <<'PYEOF'
import json, sys
for p in json.load(open(sys.argv[1])).get("points", []):
    f = p["frac_of_read_roofline"]
    print(f"sparse_decode: ctx {p['context']} budget {p['fraction']}: bytes "
          f"{p['bytes_ratio']:.3f}x dense, time {p['sparse_ms']:.3f} / {p['dense_ms']:.3f} ms, "
          f"of the read roofline: sparse {100 * f['sparse']:.0f}%, dense {100 * f['dense']:.0f}%")
    if "sparse_ragged_ms" in p:
        print(f"  via the ragged kernel: {p['sparse_ragged_ms']:.3f} ms, "
              f"{100 * p['frac_of_read_roofline_ragged']:.0f}% of the read roofline")
PYEOF
  fi
fi

if want kvdtype; then
  # The model dtype ("auto": bf16 on h200) and the quantized pools in one process, same data.
  # shellcheck disable=SC2086
  run_stage kvdtype "$T_KVDTYPE" "$KB_LOG" "$KB_KV" "$PYTHON" -m experiments.kernel_bench \
    "--config=experiments/configs/kernel_bench.py:$KB_VARIANT" "--config.ops=('decode',)" \
    "--config.decode_impls=$KV_IMPLS" "--config.kv_impls=$KV_IMPLS" \
    "--config.kv_cache_dtypes=('int8', 'fp8_e4m3')" "--config.kv_scale_granularity=page" \
    "--out=$KB_KV" $KB_FLAGS
fi
if want simval; then
  # sim_gpu_check writes sim_gpu_check.json (and .diff for a dirty tree) into its output_dir.
  run_stage simval "$T_SIMVAL" "$EB_LOG" - "$PYTHON" -m experiments.sim_gpu_check \
    "--config=experiments/configs/sim_gpu_check.py:$SV_VARIANT" "--config.output_dir=$SITE/simval"
  [ -f "$SITE/simval/sim_gpu_check.json" ] && cp "$SITE/simval/sim_gpu_check.json" "$SV_JSON"
fi

# Logs: cap each at 15 MiB (first and last 7 MiB).
for f in "$OUT"/*.log "$ENV_TXT"; do
  [ -f "$f" ] || continue
  if [ "$(stat -c %s "$f")" -gt $((15 << 20)) ]; then
    { head -c $((7 << 20)) "$f"; printf '\n[... cut ...]\n'; tail -c $((7 << 20)) "$f"; } >"$f.cut"
    mv "$f.cut" "$f"
  fi
done
rm -f "$OUT"/*.tmp

SUMMARY="$OUT/summary.txt"
{
  echo "===== device_check summary ($(date -u +%FT%TZ), $((SECONDS - T_START))s total)"
  echo "stages:$STATUS"
  timeout 15 "$PYTHON" - "$ENV_TXT" "$EB_JSON" "$KB_DECODE" "$KB_RAGGED" "$KB_GRID" "$KB_KV" "$SV_JSON" <<'EOF' || echo "(summary script failed: rc=$?)"
import json, os, sys

env_txt, eb, kd, kr, kg, kq, sv = sys.argv[1:8]
if os.path.exists(env_txt):
    keys = ("revision", "jax ", "devices", "device_kind", "memory bytes_limit", "import ok",
            "import FAILED", "ml_collections ", "jax_pallas_use_mosaic_gpu",
            "triton compiler params", "trivial Triton", "first matmul", "tree sha256", "Python ")
    for line in open(env_txt, errors="replace"):
        if line.startswith(keys) or "NVIDIA H" in line or "Driver Version" in line:
            print("env:", line.rstrip()[:300])


def e(x):
    return "n/a" if x is None else f"{x:.2e}"


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:  # noqa: BLE001
        print(f"{os.path.basename(path)}: not readable ({type(e).__name__})")
        return None


d = load(eb)
if d:
    prov = d.get("provenance", {})  # off a checkout the writer took the commit from GIT_REV
    print(f"engine_bench ({prov.get('backend')}, {prov.get('devices')}):")
    def f(r, key, spec=".3f"):
        x = r.get(key)
        return "n/a" if x is None else format(x, spec)

    for r in d.get("results", []):
        print(f"  {r.get('mode', 'steady'):6s} running={r.get('num_running')} | overlap on: step "
              f"{f(r, 'median_step_ms')} ms host {f(r, 'median_host_ms')} (sched "
              f"{f(r, 'median_schedule_ms')} prep {f(r, 'median_prepare_ms')} post "
              f"{f(r, 'median_postprocess_ms')}) device wait {f(r, 'median_device_wait_ms')} p90 host "
              f"{f(r, 'p90_host_ms')} | off: step {f(r, 'off_median_step_ms')} device "
              f"{f(r, 'off_median_device_ms')} host {f(r, 'off_median_host_ms')} | overlap speedup "
              f"{f(r, 'overlap_speedup')} step/max(dev,host) {f(r, 'step_over_max_device_host')} "
              f"host hidden {f(r, 'host_share_hidden')} | isolated host "
              f"{f(r, 'isolated_median_host_ms')} | {f(r, 'host_us_per_seq', '.2f')} us/seq | "
              f"{f(r, 'output_tokens_per_s', '.0f')} tok/s | compiles {r.get('num_compilations')}")

for path in (kd, kr, kq):
    if path == kq and not os.path.exists(path):  # kvdtype: only when asked for
        continue
    d = load(path)
    if not d:
        continue
    print(f"{os.path.basename(path)}: complete={d.get('complete')} backend={d.get('backend')} "
          f"rev={d.get('provenance', {}).get('git_describe')}")
    for op, table in d.get("kv_dtypes", {}).items():  # per KV dtype: time, bytes, read roofline
        for name, rows in table.items():
            for kv, r in rows.items():
                frac = r.get("frac_of_read_roofline")
                print(f"  kv {op} {name:<12} {kv:<9} {r['median_ms']:.4f} ms bytes {r['bytes']} "
                      f"{r['achieved_gbps']:.0f} GB/s ok={r.get('correct')} "
                      + ("n/a" if frac is None else f"{100 * frac:.1f}%") + " of its read roofline"
                      + (f" | time/auto {r['time_vs_auto']:.3f} bytes/auto {r['bytes_vs_auto']:.3f}"
                         if "time_vs_auto" in r else ""))
    for op in [*d.get("config", {}).get("ops", []), *d.get("kv_ops", [])]:
        rec = d.get(op)
        if rec is None:
            print(f"  {op}: not reached")
            continue
        chk = rec.get("oracle_check", {})
        print(f"  {op}: {rec.get('shape')} | oracle {rec.get('oracle')} (f64 spot check "
              f"{chk.get('correct')}, err {e(chk.get('max_abs_err'))}) | data {rec.get('build_s', 0):.1f}s"
              f" to device {rec.get('to_device_s', 0):.1f}s oracle {rec.get('oracle_s', 0):.1f}s total "
              f"{rec.get('op_s', 0):.1f}s")
        if "error" in rec:
            print(f"    OP ERROR [{rec.get('error_stage')}] {rec['error'][:600]}")
        for name, err in rec.get("oracle_errors", {}).items():
            print(f"    oracle {name} ERROR {err['error'][:300]}")
        rd = rec.get("read", {})
        if "gbps" in rd:
            print(f"    read: {rd['median_ms']:.3f} ms {rd['gbps']:.0f} GB/s read only "
                  f"({100 * rd['frac_of_datasheet']:.0f}% of datasheet); XLA bytes accessed "
                  f"{rd.get('xla_bytes_accessed')} of pool {rd.get('pool_bytes')}, single pass "
                  f"{rd.get('single_pass')}")
        if "error" in rd:
            print(f"    read ERROR {rd['error'][:300]}")
        c = rec.get("copy", {})
        if "gbps" in c:
            print(f"    copy: {c['median_ms']:.3f} ms {c['gbps']:.0f} GB/s r+w "
                  f"({100 * c['fraction_of_peak']:.0f}% of peak)")
        elif "quick_gbps" in c:
            print(f"    copy (quick, not interleaved): {c['quick_median_ms']:.3f} ms "
                  f"{c['quick_gbps']:.0f} GB/s r+w")
        if "error" in c:
            print(f"    copy ERROR {c['error'][:300]}")
        groups = [("", rec.get("impls", {})), ("dense:", rec.get("dense", {}))]
        for prefix, entries in groups:
            for name, r in entries.items():
                label = prefix + name
                if "error" in r:
                    print(f"    {label:<22} ERROR [{r.get('error_stage')}] {r['error'][:600]}")
                    continue
                if "median_ms" not in r:
                    q, qc = r.get("quick_median_ms"), c.get("quick_gbps")
                    timed = "(not timed)" if q is None else (
                        f"quick {q:.4f} ms {r.get('quick_gbps', 0):.0f} GB/s"
                        + (f" {100 * r.get('quick_gbps', 0) / qc:.1f}% quick copy" if qc else ""))
                    print(f"    {label:<22} ok={r.get('correct')} err={e(r.get('max_abs_err'))} "
                          f"first {r.get('first_call_s', 0):.1f}s {timed}")
                    continue
                line = (f"    {label:<22} ok={r.get('correct')} err={e(r.get('max_abs_err'))} "
                        f"{r['median_ms']:.4f} ms first {r.get('first_call_s', 0):.1f}s")
                if "achieved_gbps" in r:
                    nan = float("nan")
                    line += (f" {r['achieved_gbps']:.0f} GB/s {100 * r.get('frac_of_datasheet', nan):.1f}%"
                             f" datasheet {100 * r.get('frac_of_copy', nan):.1f}% copy "
                             f"{100 * r.get('frac_of_read_roofline', nan):.1f}% read")
                if "ratio_to_dense" in r:  # the median of per-round ratios, then their range
                    line += f" paged/dense {r['ratio_to_dense']:.3f}"
                    rr = r.get("ratio_to_dense_rounds")
                    if rr:
                        line += f" [{rr['min']:.3f}, {rr['max']:.3f}] iqr {rr['iqr']:.3f}"
                print(line)

d = load(kg)
if d:
    g = d.get("decode_grid", {})
    print(f"{os.path.basename(kg)}: complete={d.get('complete')} backend={d.get('backend')} "
          f"points {len(g.get('points', []))}/{len(g.get('shapes', []))} in {g.get('op_s', 0):.0f}s "
          f"(splits: {g.get('heuristic')})")
    if "error" in g:
        print(f"  GRID ERROR {g['error'][:600]}")
    try:
        from experiments.kernel_bench_lib import grid_line
    except Exception as e:  # noqa: BLE001
        grid_line = lambda p: json.dumps({k: p.get(k) for k in ("dtype", "context", "batch")})
        print("  (grid_line unavailable:", type(e).__name__, e, ")")
    for p in g.get("points", []):
        print("  " + grid_line(p))

if os.path.exists(sv):  # simval: the roofline simulator against this device's serving run
    d = load(sv)
    if d:
        res, w = d.get("results", {}), d.get("workload", {})
        print(f"sim_gpu_check: {w.get('num_requests')} requests ({w.get('label')}), copy "
              f"{d.get('copy_bandwidth_bytes_s', 0) / 1e9:.0f} GB/s")
        for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"):
            real = res.get("real", {}).get(k)
            cells = [f"{v}: {res.get(v, {}).get(k) or 0:.2f} ({100 * (res.get(v + '_rel_error', {}).get(k) or 0):+.0f}%)"
                     for v in ("roofline_h200", "roofline_measured")]
            print(f"  {k}: real {real or 0:.2f} | " + " | ".join(cells))
EOF
  # Stages that timed out or crashed: where their logs ended.
  [ -f "$SITE/sparse_summary.txt" ] && cat "$SITE/sparse_summary.txt"
  [ -f "$SITE/tails.txt" ] && cat "$SITE/tails.txt"
  echo "--- files in $OUT"
  ls -la "$OUT"
} 2>&1 | tee "$SUMMARY"
