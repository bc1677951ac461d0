"""The search pre-ranker's analytic figures for one config (no compile): transport, peak,
step time and collective bytes per axis.

    PYTHONPATH=. python3 tools/plan_estimate.py MODEL.yaml,LAYOUT.yaml "key=v,key=v" 2048xh800
"""
import sys

from maxmoe.cluster import load_cluster
from maxmoe.config_files import load_config
from maxmoe.plan import prerank
from maxmoe.plan.estimate import state_bytes
from maxmoe.validation import dcn_sizes, validate

files, over, clus = sys.argv[1].split(","), sys.argv[2].split(",") if sys.argv[2] else [], sys.argv[3]
cfg, origins = load_config(files, over)
cluster = load_cluster(clus)
sizes = validate(cfg, cluster.devices, origins, cluster.hosts)
layout = prerank.Layout(sizes, dcn_sizes(cfg), cfg.model.remat_policy, cfg.train.grad_accum_steps,
                        cfg.mesh.weights)
st = state_bytes(cfg, sizes)
est = prerank.estimate(cfg, layout, cluster, st)
print(prerank.transport(cfg, layout), f"peak {est.peak/2**30:.1f} GiB temp {est.temporaries/2**30:.1f} step {est.step_s:.2f}")
for a, v in prerank.comm_bytes(cfg, layout, st).items():
    print(a, {k: round(x/1e9,1) for k,x in v["estimate"].items()})
