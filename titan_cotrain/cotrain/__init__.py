"""Co-training the draft inside the policy's step: the TTT unroll (``ttt``) and the step (``step``)."""
