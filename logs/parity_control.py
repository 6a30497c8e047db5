"""Control for logs/actor_parity.py: the same comparison with the pack's boundaries withheld.

The packed tokens are fed as ONE long sequence (positions 0..N-1, no cu_seqlens), so every
sample attends to the samples before it. The differences must be large (> 0.1): that is
what shows the parity check would catch a pack whose boundaries leak.

    python logs/parity_control.py
"""

from actor_parity import as_pack_layout, run, withhold_boundaries

if __name__ == "__main__":
    run("CONTROL padded [B, T] vs the pack fed as one sequence (boundaries withheld)", "parity_control.out",
        feed=withhold_boundaries, relayout=as_pack_layout)
