"""The load tests' image set (generated defect images or a folder of the user's own images).

The code lives in :mod:`visionserve_tools.benchclient.images` so that ``visionserve bench`` (installed
as a package, without this folder) and the locustfile use one definition; see that module for
the spec syntax (``gen:640x480``, ``gen:640x480,1280x1024:n=40:q=90``, or a folder path).
"""

from __future__ import annotations

from visionserve_tools.benchclient.images import (
    DEFAULT_SPEC,
    Frame,
    ImageSetError,
    from_folder,
    generated,
    load,
    parse_sizes,
)

__all__ = ["DEFAULT_SPEC", "Frame", "ImageSetError", "from_folder", "generated", "load", "parse_sizes"]
