"""In-training sensors (docs/sensors.md): a training loop's own GEMMs checked on its real tensors,
suspicions verified off the critical path, confirmed ones saved as vTasks for ``aegis replay``.

    from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument

    handle = instrument(model, SensorConfig(bundle_dir="vtasks/"))
    for batch in loader:
        loss = model(batch).loss
        loss.backward()
        if handle.step() is Action.STOP:   # verify at the step boundary, before the update
            break                          # corruption confirmed: keep handle.last_clean_step
        optimizer.step()
    uninstrument(model)

Training-state guards (docs/training-guards.md): ``TrainingGuard`` checks Adam's moments and
normalisation statistics against their bounds and re-executes the last steps from a snapshot;
``OutlierWarning`` compares per-rank checksum statistics over torch.distributed; ``handoff``
classifies a confirmed event (this GPU, software, transient) with exit codes for a scheduler.

Importing this package imports torch, never click, rich, CuPy or NVML.
"""

from aegis_cli.sensors.config import SensorConfig
from aegis_cli.sensors.events import Action, SensorEvent, SensorStats
from aegis_cli.sensors.guards import GuardEvent, TrainingGuard, TrainingStateError
from aegis_cli.sensors.handle import SensorHandle, checkpoint, instrument, uninstrument
from aegis_cli.sensors.outlier import OutlierWarning

__all__ = ["Action", "GuardEvent", "OutlierWarning", "SensorConfig", "SensorEvent", "SensorHandle", "SensorStats",
           "TrainingGuard", "TrainingStateError", "checkpoint", "instrument", "uninstrument"]
