"""The recall tier: nothing read is lost. Rows that leave the device cache wait in host memory
(``tier.py``: pages with Quest's key bounds, RAM or a memory-mapped file), and each new question brings
back the rows it needs (``select.py``: candidates by page bounds, then the configured method's exact
scores over the device cells and the candidates together)."""

from kvlocal.recall.select import Candidates, choose_candidates, evicted, store_evicted, with_candidates
from kvlocal.recall.tier import CHUNK, PAGE, HostTier, Pool, TierFull, check_spill_dir, parse_size

__all__ = ["CHUNK", "PAGE", "Candidates", "HostTier", "Pool", "TierFull", "check_spill_dir", "choose_candidates",
           "evicted", "parse_size", "store_evicted", "with_candidates"]
