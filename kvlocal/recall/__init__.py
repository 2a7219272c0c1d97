"""The recall tier: nothing read is lost, up to its RAM cap. Rows that leave the device cache wait in host memory
(``tier.py``: pages with Quest's key bounds, in RAM under a cap or a memory-mapped file: ``memory.py``), and each new question brings
back the rows it needs (``select.py``: candidates by page bounds, then the configured method's exact
scores over the device cells and the candidates together; ``reselect.py``: a question's and its answer's first tokens'
re-selections, on the engine's cells)."""

from kvlocal.recall.select import Candidates, choose_candidates, evicted, store_evicted, with_candidates
from kvlocal.recall.memory import (Pool, TierFull, TierMemory, check_spill_dir, default_recall_mem, default_spill_dir,
                                   recall_mem_setting)
from kvlocal.recall.tier import CHUNK, PAGE, HostTier, tier_figures
from kvlocal.recall.reselect import Reselection

__all__ = ["CHUNK", "PAGE", "Candidates", "HostTier", "Pool", "Reselection", "TierFull", "TierMemory", "check_spill_dir",
           "choose_candidates", "default_recall_mem", "default_spill_dir", "evicted", "recall_mem_setting",
           "store_evicted", "tier_figures", "with_candidates"]
