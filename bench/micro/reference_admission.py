"""Pure-Python references for the compiled admission core, kept for comparison.

They do the same work as velocity_fast.admission.bands (FIFO per tenant, round-robin
between tenants, counts and bytes, cancel by id) and admission.saturation (one
endpoint's number from a scrape), written the straightforward way; the micro
benchmarks time both in the same run.
"""

from collections import deque


class RefBands:
    """Round-robin over tenant deques, one band, cancel by id via a dict."""

    def __init__(self):
        self.tenants = {}
        self.ring = deque()
        self.items = {}
        self.count = 0
        self.nbytes = 0
        self.next_id = 1

    def enqueue(self, waiter, tenant, nbytes, tokens, deadline, now):
        """Queue one item; return its id."""
        rid = self.next_id
        self.next_id += 1
        item = [rid, waiter, tenant, nbytes, tokens, deadline, now, True]
        q = self.tenants.get(tenant)
        if q is None:
            q = self.tenants[tenant] = deque()
        if not q:
            self.ring.append(tenant)
        q.append(item)
        self.items[rid] = item
        self.count += 1
        self.nbytes += nbytes
        return rid

    def pop(self):
        """Next item by turns between tenants, or None."""
        while self.ring:
            tenant = self.ring.popleft()
            q = self.tenants[tenant]
            while q and not q[0][7]:
                q.popleft()
            if not q:
                continue
            item = q.popleft()
            if q:
                self.ring.append(tenant)
            item[7] = False
            del self.items[item[0]]
            self.count -= 1
            self.nbytes -= item[3]
            return item
        return None


class RefLoad:
    """One endpoint's state for the reference saturation."""

    def __init__(self, limit):
        self.limit = limit
        self.inflight = 0
        self.running = self.waiting = self.kv = self.scraped_at = 0.0
        self.capacity = 0.0
        self.capacity_known = False


def ref_update(load, running, waiting, kv, scraped_at, now, queue_threshold=5.0, kv_threshold=0.8, stale_after=1.0):
    """Record a scrape and return the endpoint's saturation."""
    load.running, load.waiting, load.kv, load.scraped_at = running, waiting, kv, scraped_at
    load.capacity = max(load.capacity, running)
    if waiting > 0 and running > 0:
        load.capacity_known = True
    cap = load.capacity if load.capacity_known else max(load.capacity, load.limit)
    queued = max(0.0, load.inflight - max(cap, 1.0))
    use = load.inflight / load.limit if load.limit > 0 else 0.0
    if scraped_at > 0 and now - scraped_at <= stale_after:
        return max(max(queued, waiting) / queue_threshold, kv / kv_threshold, use)
    return max(queued / queue_threshold, use)
