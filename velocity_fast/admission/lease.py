"""The lease: an admission slot held for the whole response, stream included.

``Lease`` is compiled with the rest of the request path (_core/admission.pyx); this
module names it where it has always been found.
"""

from __future__ import annotations

from .._core.admission import OUTCOMES, Lease

__all__ = ["Lease", "OUTCOMES"]
