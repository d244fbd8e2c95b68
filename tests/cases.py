"""The cases the multi-rank scenarios run per method, shared by tests/ranks.py (inside the ranks) and
tests/test_multirank.py (which reports one result per scenario and case, from one launch): plain data, no side
effects, so that the test module can import it."""

from __future__ import annotations

import os

#: scenario ``train`` (and ``resume``, by label): a compression config per label
TRAIN_CONFIGS: dict[str, object] = {
    "none": "none",
    "fp16": "fp16",
    "terngrad": {"method": "terngrad", "min_numel": 100},
    "terngrad-two-phase": {"method": "terngrad", "collective": "two_phase", "min_numel": 100},
    "topk": {"method": "topk", "options": {"ratio": 0.05}, "min_numel": 100},
    "randomk": {"method": "randomk", "options": {"ratio": 0.1}, "min_numel": 100},
    "powersgd": {"method": "powersgd", "options": {"start_iter": 3}, "min_numel": 100},
    "bingrad": {"method": "bingrad", "min_numel": 100},
    "orq": {"method": "orq", "min_numel": 100},
    "orq-two-phase": {"method": "orq", "collective": "two_phase", "min_numel": 100},
    "qsgd": {"method": "qsgd", "options": {"bucket_size": 128}, "min_numel": 100},
    "signsgd": {"method": "signsgd", "min_numel": 100},
    "signsgd-two-phase": {"method": "signsgd", "collective": "two_phase", "min_numel": 100},
    "efsignsgd": {"method": "efsignsgd", "min_numel": 100},
    "onebit": {"method": "onebit", "min_numel": 100},
    "threshold": {"method": "threshold", "options": {"density": 0.05}, "min_numel": 100},
    "dgc": {"method": "dgc", "options": {"density": 0.01, "warmup_steps": 2}, "min_numel": 100},
    "topk-sketch": {"method": "topk", "options": {"ratio": 0.05}, "collective": "sketch", "min_numel": 100},
    "gravac": {"method": "gravac", "min_numel": 100,
               "options": {"candidates": [10, 100], "warmup_steps": 1, "window": 1, "interval": 2}},
    "gravac-dgc": {"method": "gravac", "min_numel": 100,
                   "options": {"method": "dgc", "candidates": [10, 100], "warmup_steps": 1, "window": 1,
                               "interval": 2}},
    "mixed": {"method": "terngrad", "min_numel": 0, "dense": ["4.*"],
              "overrides": [{"match": "2.*", "method": "topk", "options": {"ratio": 0.1}},
                            {"match": "*.bias", "method": "fp16"}]},
    # buckets of about 20 KiB: layers 4 and 2 in one (topk-buckets), layer 0 in another
    "topk-buckets": {"method": "topk", "options": {"ratio": 0.05}, "min_numel": 0, "bucket_cap_mb": 0.02},
    "mixed-buckets": {"method": "terngrad", "min_numel": 0, "bucket_cap_mb": 0.02,
                      "overrides": [{"match": "4.*", "method": "qsgd"}, {"match": "0.*", "method": "powersgd"}]},
    # PowerSGD's three matrices (of three shapes) in one bucket
    "powersgd-buckets": {"method": "powersgd", "options": {"start_iter": 1, "batch_tensors_with_same_shape": True},
                         "min_numel": 0, "bucket_cap_mb": 1},
}

#: scenario ``resume``: the labels of TRAIN_CONFIGS resumed from a checkpoint; "elsewhere": one refused by another
#: method or another world size
RESUME_LABELS = ("terngrad", "topk", "terngrad-two-phase", "randomk", "powersgd", "bingrad", "orq-two-phase", "qsgd",
                 "signsgd", "efsignsgd", "onebit", "threshold", "dgc", "gravac", "gravac-dgc", "topk-sketch",
                 "topk-buckets", "powersgd-buckets", "elsewhere")
#: scenario ``collectives``: each default reduction against its reference, then the two-phase reduction
COLLECTIVE_LABELS = ("fp16", "terngrad", "terngrad-noshare", "terngrad-noclip", "topk", "topk-ef", "randomk",
                     "randomk-ef", "bingrad", "onebit", "orq", "orq-3bit", "qsgd", "qsgd-max-8bit", "efsignsgd",
                     "threshold", "dgc", "two_phase-exact", "two_phase-random")
#: scenario ``digits``: the methods that train the digits classifier to within a point of dense (and dense itself)
DIGITS_METHODS = ("none", "bingrad", "orq", "qsgd", "signsgd", "efsignsgd", "onebit", "dgc", "threshold", "gravac",
                  "lgc", "lgc-ps")
#: scenario ``digits``: the methods that train it above 90% (one seed), compressed more than 3x
DIGITS_TRAIN = ("powersgd", "randomk")
#: the scenarios that report a result per case (``SCENARIO CASE OK rank R``), and their cases
#: scenario ``buckets``: the TRAIN_CONFIGS labels whose buckets are checked against their reduction run alone
BUCKET_LABELS = ("mixed-buckets", "topk-buckets", "powersgd-buckets")
CASES = {"train": tuple(TRAIN_CONFIGS), "resume": RESUME_LABELS, "buckets": BUCKET_LABELS,
         "collectives": COLLECTIVE_LABELS, "digits": (*DIGITS_METHODS, *DIGITS_TRAIN)}

#: The device of the scenarios' tensors: "cpu" (the default) or "cuda" (``HVDCOMP_TEST_DEVICE=cuda``: tests/ranks.py
#: puts each rank's models, data and gradients on its GPU; several ranks can share one GPU only through a Horovod built
#: without GPU operations, launch/setup.sh's HVDCOMP_HOROVOD_GPU_OPS=none; perf/gpu/gpu_multirank.sh runs them so).
TEST_DEVICE = os.environ.get("HVDCOMP_TEST_DEVICE") or "cpu"
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"HVDCOMP_TEST_DEVICE={TEST_DEVICE!r}: valid values are cpu and cuda")
#: The scenarios of tests/ranks.py that run on CPU tensors only, and why; every other one runs on CUDA tensors too.
CPU_ONLY_SCENARIOS = {
    "digits": "hvdcomp train's digits runs, 26 of them, choose their own device and take minutes",
    "powersgd_reference": "PyTorch's powerSGD_hook runs in DDP over gloo on CPU tensors here",
    "auto": "the slow link is 2 emulated hosts (tests/test_cluster.py), not a GPU's",
    "raises": "the launcher ending a job whose rank raised: nothing on the tensors' device",
    "stall": "the deadline ending a stalled job: nothing on the tensors' device",
    "auto_stall": "the deadline ending a job stalled in auto: nothing on the tensors' device",
    "auto_stall_probe": "the deadline ending a job stalled in auto's probe: nothing on the tensors' device",
}
