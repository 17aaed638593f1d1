"""Frontend: model sources, the architecture table and torch.export tracing."""

from octavo.frontend.architectures import ARCHITECTURES, Architecture, architecture_for
from octavo.frontend.sources import ModelSource, load_model
from octavo.frontend.trace import TracedModel, trace

__all__ = ["ARCHITECTURES", "Architecture", "ModelSource", "TracedModel", "architecture_for", "load_model", "trace"]
