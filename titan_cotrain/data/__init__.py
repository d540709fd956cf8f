"""Packed rows: documents laid end to end, ``cu_seqlens``, in-document positions and shifts."""
