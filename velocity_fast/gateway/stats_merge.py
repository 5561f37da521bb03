"""Several workers' /stats as one gateway's (gateway/workers.py answers the admin port with it).

The rule is uniform: numbers at the same path are summed (each worker's share: its
requests, its queues), booleans or'ed, lists of named things merged by name, other lists
joined, words taken from the first worker. The exception is declared where a number is
produced: a module that builds a part of /stats names the keys whose numbers every worker
reports whole (the shared memory, the engines' scrapes, a setting) in its ``STATS_WHOLE``
(``Gateway``, ``Admission``, ``Endpoint``), and a worker asked for ``/stats?merge`` sends
them along (``"merge": {"largest": [...]}``); under those keys, at any depth, the largest
is taken. Nothing here names a key.
"""

from __future__ import annotations

from typing import Any, Collection

__all__ = ["MERGE_KEY", "merge_stats", "take_rules"]

MERGE_KEY = "merge"  # where a worker's /stats?merge carries its declarations


def take_rules(answer: dict) -> frozenset[str]:
    """The keys a worker's /stats answer declares whole, removed from it."""
    rules = answer.pop(MERGE_KEY, None)
    largest = rules.get("largest") if isinstance(rules, dict) else None
    return frozenset(k for k in largest if isinstance(k, str)) if isinstance(largest, list) else frozenset()


def _merge_value(a: Any, b: Any, take_max: bool, whole: Collection[str]) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) or bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b) if take_max else a + b
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge_value(out.get(k), v, take_max or k in whole, whole)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if all(isinstance(x, dict) and "name" in x for x in a + b):
            by_name: dict[str, dict] = {}
            for x in a + b:
                by_name[x["name"]] = _merge_value(by_name.get(x["name"]), x, take_max, whole)
            return list(by_name.values())
        out_list = list(a)
        for x in b:
            if x not in out_list:
                out_list.append(x)
        return out_list
    return a  # a word (the policy, a state): the first worker's


def merge_stats(stats: list[dict], whole: Collection[str] = ()) -> dict:
    """Several workers' /stats as one gateway's: numbers at the same path summed (the
    largest under a key in ``whole``, at any depth), lists of named things merged by name."""
    out: dict = {}
    for s in stats:
        out = _merge_value(out, s, False, whole)
    return out
