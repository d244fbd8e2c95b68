"""The cases the multi-rank scenarios run per method, shared by tests/ranks.py (inside the ranks) and
tests/test_multirank.py (which reports one result per scenario and case, from one launch): plain data, no side
effects, so that the test module can import it."""

from __future__ import annotations

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
}

#: scenario ``resume``: the labels of TRAIN_CONFIGS resumed from a checkpoint
RESUME_LABELS = ("terngrad", "topk", "terngrad-two-phase", "randomk", "powersgd", "bingrad", "orq-two-phase", "qsgd",
                 "signsgd", "efsignsgd", "onebit", "threshold", "dgc", "gravac", "gravac-dgc", "topk-sketch")
#: scenario ``collectives``: each default reduction against its reference, then the two-phase reduction
COLLECTIVE_LABELS = ("fp16", "terngrad", "terngrad-noshare", "terngrad-noclip", "topk", "topk-ef", "randomk",
                     "randomk-ef", "bingrad", "onebit", "orq", "orq-3bit", "qsgd", "qsgd-max-8bit", "efsignsgd",
                     "threshold", "dgc", "two_phase-exact", "two_phase-random")
#: scenario ``digits``: the methods that train the digits classifier to within a point of dense (and dense itself)
DIGITS_METHODS = ("none", "bingrad", "orq", "qsgd", "signsgd", "efsignsgd", "onebit", "dgc", "threshold", "gravac",
                  "lgc", "lgc-ps")
#: the scenarios that report a result per case (``SCENARIO CASE OK rank R``), and their cases
CASES = {"train": tuple(TRAIN_CONFIGS), "resume": RESUME_LABELS, "collectives": COLLECTIVE_LABELS,
         "digits": DIGITS_METHODS}
