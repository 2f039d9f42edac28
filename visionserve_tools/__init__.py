"""Tooling around the visionserve server, shipped in the same wheel but never imported by it:
benchmarks (``visionserve bench``, :mod:`.benchgpu`), the guard's acceptance run
(:mod:`.benchguard`), the load generator (:mod:`.benchclient`) and the synthetic
industrial-surface images (:mod:`.synthetic`) that the load tests and the training scripts use.

The runtime package :mod:`visionserve` reaches this package only through the ``visionserve``
command's lazy dispatch (``visionserve/cli.py``); nothing here is loaded when the server runs.
"""
