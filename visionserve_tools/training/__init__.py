"""The scripts that make a model: synthetic data sets (:mod:`.generate`), training (:mod:`.train`),
export to ONNX and torch.export with an agreement check (:mod:`.export`), evaluation as served
(:mod:`.evaluate`). Each runs as ``python -m visionserve_tools.training.<script>``; the shipped
``models/defect-classifier`` was made by them. Preprocessing is the server's own
(:mod:`visionserve.imaging`), so what a model sees in training is what it sees when served.
"""
