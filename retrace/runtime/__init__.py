"""retrace.runtime: the lossless ReTrace draft/verify loop, its backends and the embeddable API."""

from retrace.runtime.api import Result, Runtime
from retrace.runtime.loop import MODES, Event, Request, Scheduler
from retrace.runtime.sampling import SamplingParams
from retrace.runtime.serving_engine import Engine, ServingEngine

__all__ = ["Engine", "ServingEngine", "Runtime", "Result", "Scheduler", "Request", "Event", "SamplingParams", "MODES"]
