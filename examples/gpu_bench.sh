#!/usr/bin/env bash
# The GPU rows of BENCHMARKS.md: jaxrl vs TRL 1.16 / transformers on one CUDA device.
#
#   bash examples/gpu_bench.sh OUT_DIR [STAGE ...]
#
# Stages (default: all, in this order): env, forward, attention, sft, dpo, generate.
# `attention` times cuDNN attention forward + backward with the mask passed as a bias, with
# causality only, and with sequence lengths (examples/attention_mask_bench.py). `profile` (not
# in the default list) traces three forward+backward steps and writes the per-op summary of
# examples/trace_top.py to OUT_DIR/trace_top.txt (XLA runs op by op while profiling;
# `profile_cb` traces with its command buffers kept); `flags` (not in the default list) reruns
# the forward+backward under XLA:GPU runtime variants (command buffers off, more op types in
# them, smaller graphs, an exclusive GPU lock), one JSON line each after a {"xla_flags": ...}
# line. Each writes its JSON lines and log under OUT_DIR; a failing stage is logged and the next
# one runs. Needs jaxrl's dependencies plus the `test` extra (trl) on a machine with one GPU.
# Run from the repo root.
set -u
out=${1:?usage: gpu_bench.sh OUT_DIR [STAGE ...]}
shift
mkdir -p "$out"
stages=${*:-env forward attention sft dpo generate}
preset=${PRESET:-qwen2.5-0.5b}
seq=${SEQ_LEN:-1024}
steps=${STEPS:-10}
warmup=${WARMUP:-3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

run() {  # run NAME TIMEOUT CMD...: stdout's JSON lines to NAME.jsonl, everything to NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*" | tee -a "$out/$name.log"
    local t0=$SECONDS
    timeout "$limit" "$@" > >(tee -a "$out/$name.log" | grep '^[[{]' >>"$out/$name.jsonl") \
        2>>"$out/$name.log"
    echo "=== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
}

for stage in $stages; do
    case $stage in
    env)
        { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
          python3 -c 'import jax, jaxlib, flax, optax, torch, transformers, trl, datasets
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__,
      "optax", optax.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__, "trl", trl.__version__,
      "datasets", datasets.__version__)
print(jax.devices())'; } 2>&1 | tee "$out/env.log"
        ;;
    forward)  # forward + backward of the LM loss only (issue 14: MFU >= 50%, compile < 30 s)
        run forward 400 python3 -m jaxrl.bench --algo forward --preset "$preset" \
            --seq_len "$seq" --bf16 true --gradient_checkpointing false \
            --per_device_train_batch_size "${FWD_BATCH:-8}" --steps "$steps" --warmup "$warmup"
        ;;
    attention)  # does the mask, passed to cuDNN as a [B, 1, T, S] bias, cost attention time?
        run attention 200 python3 examples/attention_mask_bench.py --batch "${FWD_BATCH:-8}" \
            --seq_len "$seq"
        ;;
    profile)  # where the forward+backward's device time goes, op by op
        run profile 200 python3 -m jaxrl.bench --algo forward --preset "$preset" \
            --seq_len "$seq" --bf16 true --gradient_checkpointing false \
            --per_device_train_batch_size "${FWD_BATCH:-8}" --steps 3 --warmup 1 \
            --profile_dir "$out/profile"
        python3 examples/trace_top.py "$out/profile" --steps 3 --top 50 --gaps 20 >"$out/trace_top.txt" 2>&1
        ;;
    profile_cb)  # the same trace with command buffers kept (XLA turns them off while profiling)
        XLA_FLAGS=$(echo ${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true) \
            run profile_cb 200 python3 -m jaxrl.bench --algo forward --preset "$preset" \
            --seq_len "$seq" --bf16 true --gradient_checkpointing false \
            --per_device_train_batch_size "${FWD_BATCH:-8}" --steps 3 --warmup 1 \
            --profile_dir "$out/profile_cb"
        python3 examples/trace_top.py "$out/profile_cb" --steps 3 --top 50 --gaps 20 \
            >"$out/trace_top_cb.txt" 2>&1
        ;;
    flags)  # the forward+backward under XLA:GPU runtime variants: where wall time > device time
        for flags in "" "--xla_gpu_enable_command_buffer=" \
            "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+DYNAMIC_SLICE_FUSION" \
            "--xla_gpu_graph_min_graph_size=1" "--xla_gpu_require_exclusive_lock=true"; do
            echo "{\"xla_flags\": \"$flags\"}" >>"$out/flags.jsonl"
            (  # XLA reads a blank XLA_FLAGS as a file name: set it only when there are flags
                xf=$(echo ${XLA_FLAGS:-} $flags)
                if [ -n "$xf" ]; then export XLA_FLAGS="$xf"; else unset XLA_FLAGS; fi
                run flags 300 python3 -m jaxrl.bench --algo forward --preset "$preset" \
                    --seq_len "$seq" --bf16 true --gradient_checkpointing false \
                    --per_device_train_batch_size "${FWD_BATCH:-8}" --steps "$steps" \
                    --warmup "$warmup"
            )
        done
        ;;
    sft)  # whole SFT steps (optimizer included), jaxrl then TRL 1.16 with bf16 autocast
        run sft 500 python3 -m jaxrl.bench --algo sft --compare trl --reps 1 --preset "$preset" \
            --seq_len "$seq" --per_device_train_batch_size "${SFT_BATCH:-8}" --bf16 true \
            --steps "$steps" --warmup "$warmup"
        ;;
    dpo)  # TRL's objective and layout on both sides, then jaxrl's prefix-sharing row
        run dpo 560 python3 -m jaxrl.bench --algo dpo --compare trl --reps 1 --preset "$preset" \
            --seq_len "$seq" --per_device_train_batch_size "${DPO_BATCH:-4}" --bf16 true \
            --steps "$steps" --warmup "$warmup"
        ;;
    generate)  # KV-cache sampler vs transformers generate, bf16 on the GPU for both
        run generate 400 python3 -m jaxrl.bench --algo generate --preset "$preset" \
            --dtype bfloat16 --batch "${GEN_BATCH:-32}" --prompt_len 32 --max_new_tokens 64 \
            --steps 3 --warmup 1
        ;;
    *) echo "unknown stage $stage" >&2 ;;
    esac
done
