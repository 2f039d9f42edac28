"""Assembly: what builds a serving process from its settings and runs it.

- :mod:`.serve`      the ``visionserve serve`` command: options, settings, exit codes
- :mod:`.assembly`   build the engine (and the hosted guard) from settings; serve it with the
                     front ends in this process, or hand over to :mod:`.procs`
- :mod:`.procs`      the serving process with ``--frontends N``: starts, watches and stops the
                     front-end processes
- :mod:`.frontend`   one front-end process (``python -m visionserve.runtime.frontend``)
- :mod:`.startup`    the serving process's start-up: interpreter settings, device pinning,
                     loading the models (the exit code), holding on an error
- :mod:`.hosted`     the training-queue guard hosted in the server (``--guard``)

This is the top of the package: it may import every other part, and nothing imports it but the
command line (``visionserve serve``). Its modules import nothing heavy at module level, so that
``serve`` pins the GPU (environment variables) before torch or onnxruntime load.
"""
