"""Admission: whether and when each request runs (docs/design.md, "Admission").

``Admission`` (controller.py) holds per-pool band queues (the compiled registry),
runs the dispatch cycle and hands out ``Lease``s; ``Ticket`` and ``Rejected`` are
what goes in and what comes back when the answer is no.
"""

from .controller import Admission
from .lease import Lease
from .policies import Policy, make_policy
from .settings import AdmissionConfigError, AdmissionSettings, BandSettings
from .ticket import Rejected, Ticket

__all__ = ["Admission", "Lease", "Ticket", "Rejected", "AdmissionSettings", "BandSettings",
           "AdmissionConfigError", "Policy", "make_policy"]
