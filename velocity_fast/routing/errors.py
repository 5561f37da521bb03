"""Routing's exceptions."""

from .settings import PROFILE_HEADER, PROFILES

__all__ = ["UnknownProfile"]


class UnknownProfile(ValueError):
    """The request named a routing profile that does not exist: answer 400."""

    status = 400
    type = "BadRequestError"
    param = PROFILE_HEADER

    def __init__(self, name: str) -> None:
        super().__init__(
            f"Unknown routing profile {name!r} in {PROFILE_HEADER}; expected one of: {', '.join(PROFILES)}."
        )
        self.profile = name
