"""The compiled core: per-request state and math as Cython extension types.

Nothing here imports asyncio or any other part of the package. A missing
extension is an ImportError on purpose: there is no pure-Python fallback.
"""
