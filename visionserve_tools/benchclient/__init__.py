"""The load generator behind ``visionserve bench``: image sets, wire clients, the open-loop
sender, the bare-model reference, and the report (JSON + plots). Nothing heavy at import."""
