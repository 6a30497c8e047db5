"""The transformers engine's KV cache: room reserved for the whole generation, rows selected in place.

transformers' `DynamicLayer` concatenates each new token onto the whole cache (a copy of every
layer's keys and values per token); `reserve` swaps each plain layer for `ReservedLayer`, which
writes into a buffer sized for the generation. A cache of another kind is left alone.
"""

from __future__ import annotations

import functools

import torch


def _plain_layers(cache) -> list:
    """The cache's layers if every one is a plain `DynamicLayer` (else [] : leave it alone)."""
    from transformers.cache_utils import DynamicLayer

    layers = list(getattr(cache, "layers", []))
    return layers if layers and all(type(layer) in (DynamicLayer, _reserved_layer()) for layer in layers) else []


def select_rows(cache, rows: torch.Tensor) -> None:
    """Every layer's keys/values -> their rows `rows` (the prefill of distinct prompts to every sample)."""
    for layer in cache.layers:
        layer.batch_select_indices(rows)


def reserve(cache, extra: int) -> None:
    """Give every plain layer room for `extra` more tokens, written in place (`_reserved_layer`)."""
    for i, layer in enumerate(_plain_layers(cache)):
        cache.layers[i] = _reserved_layer().around(layer, extra)


@functools.cache
def _reserved_layer():
    """The `DynamicLayer` subclass below, built on first use (the module imports without transformers)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A `DynamicLayer` whose keys/values are views of a buffer reserved for the whole
        generation: `update` writes the new tokens in place instead of concatenating (a cat
        of the whole cache per layer and token otherwise); past capacity it concatenates."""

        @classmethod
        def around(cls, layer, extra: int):
            new = cls()
            new.__dict__.update(layer.__dict__)
            if new.is_initialized and new.keys.numel():
                b, h, n, d = new.keys.shape
                new._k = new.keys.new_empty(b, h, n + extra, d)
                new._v = new.values.new_empty(b, h, n + extra, new.values.shape[-1])
                new._k[:, :, :n] = new.keys
                new._v[:, :, :n] = new.values
                new.keys, new.values = new._k[:, :, :n], new._v[:, :, :n]
            return new

        def update(self, key_states, value_states, *args, **kwargs):
            buf = self.__dict__.get("_k")
            n, m = self.keys.shape[-2] if self.is_initialized else 0, key_states.shape[-2]
            if buf is None or n + m > buf.shape[-2] or buf.shape[0] != key_states.shape[0]:
                self._k = self._v = None
                return super().update(key_states, value_states, *args, **kwargs)
            self._k[:, :, n:n + m] = key_states
            self._v[:, :, n:n + m] = value_states
            self.keys, self.values = self._k[:, :, :n + m], self._v[:, :, :n + m]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            """Keep the rows `indices` (the rows still decoding), with their reserved room: a
            smaller buffer holding only their written tokens (the room after them is not copied)."""
            if self.__dict__.get("_k") is None:
                return super().batch_select_indices(indices)
            n = self.keys.shape[-2]
            for name in ("_k", "_v"):
                buf = getattr(self, name)
                kept = buf.new_empty(len(indices), *buf.shape[1:])
                torch.index_select(buf[:, :, :n], 0, indices, out=kept[:, :, :n])
                setattr(self, name, kept)
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    return ReservedLayer
