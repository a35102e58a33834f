"""Which manager serves a spec, and which specs may share a group.

Mirrors ``vllm/v1/kv_cache_spec_registry.py``. Every spec class is registered
with two facts:

- its *manager class*: the ``SingleTypeKVCacheManager`` that allocates, frees
  and looks up blocks for a group of that spec;
- its *uniform-type base*: the spec class it groups with. Layers whose specs
  share a base (an MLA layer and a plain full-attention layer: both keep every
  token) can be one ``UniformTypeKVCacheSpecs`` group; layers of different
  bases (full attention and a window) need separate groups.

A subclass without its own registration inherits its nearest registered
ancestor's (the lookup walks the class's MRO). The built-in specs are
registered by ``kvref.core.single_type_kv_cache_manager`` when it is imported
(``register_all_kvcache_specs``; importing ``kvref`` imports it), and again
whenever a lookup finds the table empty. vLLM's registry imports that module
lazily for the same purpose; kvref's is handed the function instead
(``add_builtin_registration``), so the two modules do not import each other.
A custom spec is added with ``register`` or the ``register_kv_cache_spec``
decorator:

    >>> from dataclasses import dataclass
    >>> from kvref.kv_cache_interface import FullAttentionSpec
    >>> from kvref.core.single_type_kv_cache_manager import FullAttentionManager
    >>> @register_kv_cache_spec(manager_class=FullAttentionManager,
    ...                         uniform_type_base_spec=FullAttentionSpec)
    ... @dataclass(frozen=True, kw_only=True)
    ... class MyFullSpec(FullAttentionSpec):
    ...     pass
    >>> KVCacheSpecRegistry.get_manager_class(MyFullSpec(block_size=16)).__name__
    'FullAttentionManager'
    >>> KVCacheSpecRegistry.get_uniform_type_base_spec(MyFullSpec(block_size=16)).__name__
    'FullAttentionSpec'
    >>> KVCacheSpecRegistry.unregister(MyFullSpec)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Specs and managers are named in annotations only as strings: the spec module
# imports this one and the managers' module imports both.


@dataclass(frozen=True)
class KVCacheSpecMetadata:
    """What the registry knows about one spec class."""

    kvcache_spec_cls: type
    manager_class: type
    uniform_type_base_spec: type


# spec class -> its metadata (vLLM's module-level name, kept so tests that
# save and restore the registry find it).
_REGISTRY_KVCACHESPEC_LIST: dict[type, KVCacheSpecMetadata] = {}

# Functions that register the built-in specs (each takes a vLLM config or None).
_BUILTIN_REGISTRATIONS: list[Callable[[Any], None]] = []


def add_builtin_registration(register: Callable[[Any], None]) -> None:
    """Remember ``register`` to fill an empty table on the next lookup."""
    if register not in _BUILTIN_REGISTRATIONS:
        _BUILTIN_REGISTRATIONS.append(register)


class KVCacheSpecRegistry:
    """The process-wide table of spec classes (class methods only)."""

    @classmethod
    def _ensure_registered(cls, vllm_config: Any = None) -> None:
        """Register the built-in specs if the table is empty."""
        if _REGISTRY_KVCACHESPEC_LIST:
            return
        for register in _BUILTIN_REGISTRATIONS:
            register(vllm_config)

    @classmethod
    def register(cls, kvcache_spec_cls: type, manager_class: type | None = None,
                 uniform_type_base_spec: type | None = None) -> None:
        """Register ``kvcache_spec_cls``; its base defaults to itself.

        Registering a class again with the same facts is allowed (the built-in
        registration may run more than once); with different facts it is an
        error, as is a base the class does not inherit from. The errors are
        ``AssertionError``s, as vLLM's (raised explicitly, so ``python -O``
        keeps them).
        """
        if manager_class is None:
            raise AssertionError(f"register({kvcache_spec_cls.__name__}): "
                                 "manager_class is required")
        base = kvcache_spec_cls if uniform_type_base_spec is None else uniform_type_base_spec
        if not issubclass(kvcache_spec_cls, base):
            raise AssertionError(f"{kvcache_spec_cls.__name__} must inherit from its "
                                 f"uniform_type_base_spec {base.__name__}")
        new = KVCacheSpecMetadata(kvcache_spec_cls, manager_class, base)
        old = _REGISTRY_KVCACHESPEC_LIST.get(kvcache_spec_cls)
        if old is not None and old != new:
            raise AssertionError(f"{kvcache_spec_cls.__name__} is already registered with "
                             f"manager {old.manager_class.__name__} and base "
                             f"{old.uniform_type_base_spec.__name__}")
        _REGISTRY_KVCACHESPEC_LIST[kvcache_spec_cls] = new

    @classmethod
    def unregister(cls, kvcache_spec_cls: type) -> None:
        """Forget a registration (kvref's addition, for tests and examples)."""
        _REGISTRY_KVCACHESPEC_LIST.pop(kvcache_spec_cls, None)

    @classmethod
    def _lookup(cls, kvcache_spec: "KVCacheSpec") -> KVCacheSpecMetadata | None:
        cls._ensure_registered()
        for klass in type(kvcache_spec).__mro__:
            meta = _REGISTRY_KVCACHESPEC_LIST.get(klass)
            if meta is not None:
                return meta
        return None

    @classmethod
    def get_manager_class(cls, kvcache_spec: "KVCacheSpec") -> type | None:
        """The manager class of the nearest registered class of the spec, or None."""
        meta = cls._lookup(kvcache_spec)
        return None if meta is None else meta.manager_class

    @classmethod
    def get_uniform_type_base_spec(cls, kvcache_spec: "KVCacheSpec") -> type | None:
        """The base the spec groups with (nearest registered class), or None."""
        meta = cls._lookup(kvcache_spec)
        return None if meta is None else meta.uniform_type_base_spec

    @classmethod
    def check_kv_cache_spec_registry(cls, kv_cache_spec: dict[str, "KVCacheSpec"]) -> None:
        """Raise ``ValueError`` naming the first layer whose spec is not registered."""
        cls._ensure_registered()
        for layer_name, spec in kv_cache_spec.items():
            if cls._lookup(spec) is None:
                raise ValueError(f"Unsupported KV cache spec type for layer {layer_name}: "
                                 f"{type(spec).__name__} is not registered (use "
                                 "@register_kv_cache_spec)")


def register_kv_cache_spec(manager_class: type | None = None,
                           uniform_type_base_spec: type | None = None):
    """Class decorator: ``KVCacheSpecRegistry.register`` the decorated spec."""

    def decorate(kvcache_spec_cls: type) -> type:
        KVCacheSpecRegistry.register(kvcache_spec_cls, manager_class, uniform_type_base_spec)
        return kvcache_spec_cls

    return decorate


__all__ = ["KVCacheSpecMetadata", "KVCacheSpecRegistry", "add_builtin_registration",
           "register_kv_cache_spec"]
