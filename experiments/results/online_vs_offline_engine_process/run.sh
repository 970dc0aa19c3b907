cd /work/main
for i in 1 2; do
 for ep in False True; do
  uptime
  .venv/bin/python -m experiments.online_vs_offline "--config.rates=(400.0,)" --config.repeats=3 --config.engine_process=$ep --config.output_dir=/tmp/ovo/ep$ep-$i 2>&1 | grep -v "^\s*$" | tail -14
 done
done
