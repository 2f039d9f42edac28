"""Several front-end processes feeding the one engine process (``visionserve serve --frontends N``).

One Python process parses a few thousand HTTP requests a second at best; a GPU runs ResNet-50 at
over ten thousand frames a second. With ``--frontends N`` the serving process keeps the engine
(the batchers, the runners, the GPU: one batch queue per model) and starts N front-end processes
that share the HTTP listening socket (and the gRPC port, through SO_REUSEPORT). Each front end
parses requests and checks frames at the door exactly as the in-process front end does, then hands
the frame bytes to the engine through a shared-memory arena and a small message on a socket pair
(:class:`visionserve.framing.Channel`: length-prefixed messages, coalesced per loop turn).

- :mod:`.arena`    the shared-memory arena a front end writes frame bytes into
- :mod:`.hub`      the engine side: takes requests from every front end, answers them
- :mod:`.remote`   the front-end side: an engine look-alike the HTTP and gRPC front ends call

The processes themselves (the serving process starting, watching and stopping the front ends;
one front-end process) are assembly: :mod:`visionserve.runtime.procs` and
:mod:`visionserve.runtime.frontend`.
"""
