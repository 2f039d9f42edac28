"""The closed loop's training and evaluation (docs/closed-loop.md): a model's labelled captures
exported into a candidate's folder, its training (the project's classifier's fine-tune, an
anomaly model's refit with its good parts, or the model's own [training] command) run as a guard
job into the model's candidates area (never served), and the candidate compared with the live
version on the held-out labelled frames (a guard job too). The routes are :mod:`.http`."""
