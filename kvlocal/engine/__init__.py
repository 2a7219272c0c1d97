"""Bounded prefill and decoding: the engine (``engine.py``) holds and calls its parts — the cells it decodes into
(``cells.py``), the observer that decodes an event's observation (``observer.py``; the queries' reuse:
``observation.py``), the compressor that runs an event (``compressor.py``), a question's re-selection with the recall
tier (:mod:`kvlocal.recall.reselect`) and an endless session's positions (``positions.py``); its budget, settings and
figures (``config.py``), Ctrl-C inside work that must not be cut in half (``interrupts.py``), and a turn undone by
what it changed (``undo.py``)."""

from kvlocal.engine.config import DECODE_OBSERVATIONS, DECODE_OBSERVE, LOW_WATER, OBSERVE_EVERY, PREFILL_OBSERVATIONS, PREFILL_OBSERVE, RECALL_ROOM, RECALL_STEP_CANDIDATES, RECALL_STEP_CONFIDENCE, RECALL_STEP_EVERY, RECALL_STEPS, VALUE_NORM, Budget, EngineConfig, EngineState, EngineStats, resolve_recall
from kvlocal.engine.engine import AGNOSTIC_PROBE, Engine
from kvlocal.engine.interrupts import interrupts_deferred

__all__ = ["AGNOSTIC_PROBE", "DECODE_OBSERVATIONS", "DECODE_OBSERVE", "LOW_WATER", "OBSERVE_EVERY", "PREFILL_OBSERVATIONS", "PREFILL_OBSERVE", "RECALL_ROOM", "RECALL_STEP_CANDIDATES", "RECALL_STEP_CONFIDENCE", "RECALL_STEP_EVERY", "RECALL_STEPS", "VALUE_NORM", "Budget", "Engine", "EngineConfig", "EngineState", "EngineStats", "interrupts_deferred",
           "resolve_recall"]
