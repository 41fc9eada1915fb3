"""The peers `tokenmill bench compare` and `tokenmill bench peers` know, by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.bench.peers import LlamaCppPeer, Peer, TransformersPeer, VllmPeer
from tokenmill.bench.served_peer import TokenmillServePeer

PEERS: dict[str, type[Peer]] = {"transformers": TransformersPeer, "llamacpp": LlamaCppPeer,
                                "vllm": VllmPeer, "tokenmill-serve": TokenmillServePeer}
# Peers `tokenmill bench peers install` puts in their own environments.
INSTALLABLE = ("llamacpp", "vllm")


def peer_name(spec: str) -> str:
    """The name a peer spec reports under: `llamacpp:q8_0` -> llamacpp-q8_0."""
    base, _, variant = spec.partition(":")
    return f"{base}-{variant}" if variant and variant != "f32" else base


def available_peers(names: Sequence[str], log=print) -> list[Peer]:
    """Instances of the named peers that are installed; the others are reported, skipped.
    llama.cpp takes its GGUF type after a colon (`llamacpp:q8_0`; f32 by default)."""
    peers = []
    for name in names:
        name, _, variant = name.partition(":")
        if name not in PEERS or (variant and name != "llamacpp"):
            raise ValueError(f"unknown peer {name + (':' + variant if variant else '')!r}; "
                             f"known: {sorted(PEERS)} (llamacpp:<gguf type>)")
        peer = PEERS[name](variant) if variant else PEERS[name]()
        found = peer.detect()
        if found is None:
            log(f"skipping {peer.missing_message()}")
            continue
        log(f"peer {peer.name}: {found}")
        peers.append(peer)
    return peers


def place_peers(peers: Sequence[Peer], device: str, dtype: str,
                engine_options: Mapping[str, Any]) -> None:
    """Run the in-process transformers peer on the engines' device and in their dtype
    (`auto` resolves as the engine's loader does: bfloat16 on CUDA, float32 on the CPU),
    and serve the compare's first engine (its options) as the tokenmill-serve peer."""
    from tokenmill.model.loader import dtype_name, resolve_device, resolve_dtype

    resolved = resolve_device(device)
    for peer in peers:
        if isinstance(peer, TransformersPeer):
            peer.device = resolved.type
            peer.dtype = dtype_name(resolve_dtype(dtype, resolved))
        elif isinstance(peer, TokenmillServePeer):
            peer.options = dict(engine_options)
