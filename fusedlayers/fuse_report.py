"""The report that `fusedlayers.torch.fuse` and `fusedlayers.keras.fuse` leave on the model they
return, as `model.fusedlayers_report`. Imports no framework."""

import sys
from dataclasses import dataclass, field


def class_name(cls: type) -> str:
    """A class's public dotted name: the shortest package path that exports it
    (torch.nn.LayerNorm, keras.layers.Dense, fusedlayers.torch.LayerNorm), else its module's."""
    parts = cls.__module__.replace("keras.src.", "keras.").split(".")
    for i in range(1, len(parts)):
        package = sys.modules.get(".".join(parts[:i]))
        if package is not None and getattr(package, cls.__name__, None) is cls:
            return f"{'.'.join(parts[:i])}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class FuseReport:
    """What fuse() swapped (path, what it was, what it is now) and what it left (path, what it
    is, why it was left)."""
    swapped: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fusedlayers fuse: {len(self.swapped)} swapped, {len(self.left)} left"]
        for path, was, now in self.swapped:
            lines.append(f"  swapped {path or '(model)'}: {was} -> {now}")
        for path, what, why in self.left:
            lines.append(f"  left    {path or '(model)'}: {what}: {why}")
        return "\n".join(lines)
