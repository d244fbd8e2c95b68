"""Performance model: predict data-parallel scaling from measured cluster and model inputs.

``hvdcomp probe`` measures a cluster (:mod:`.probe`), ``hvdcomp profile`` a model (:mod:`.profile`), and
``hvdcomp predict`` (:mod:`.predict`) combines them with alpha-beta collective costs (:mod:`.costs`) in a
per-step timeline (:mod:`.timeline`), as TernGrad's performance model does from measured compute time, model
size and link bandwidth (Wen et al., NeurIPS 2017, sec. 5). Files: :mod:`.schema`; nominal clusters:
``presets/*.yaml``.
"""
