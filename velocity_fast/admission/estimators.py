"""Online estimators behind SLA prediction, learned per endpoint (EWMA).

Per endpoint: time to first token measured from dispatch (prefill plus the engine's
own queue), time per output token after the first, and whole service time. They
start unknown; until a first observation the prediction says nothing, so a cold
gateway never rejects on a guess.

Both classes are compiled with the request path that feeds them (_core/admission.pyx).
"""

from __future__ import annotations

from .._core.admission import Ewma, ServiceEstimate

__all__ = ["Ewma", "ServiceEstimate"]
