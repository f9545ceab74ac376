"""aegis: find GPUs that silently compute wrong numbers (silent data corruption).

Importing the package touches no GPU and imports no CUDA library; backends load lazily.
"""

__all__ = ["__version__"]
__version__ = "0.1.0.dev0"
