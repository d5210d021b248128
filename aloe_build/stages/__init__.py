"""The eight stages of the paper's Method section, one module each.

1. :mod:`.s1_encoder`: the address encoder, trained on a construction corpus.
2. :mod:`.s2_init`: initial addresses from the request states.
3. :mod:`.s3_rollouts`: anchors (where an edit must fire) and negatives (where it must not);
   :mod:`.s3_shared_pool`, the negatives every edit shares.
4. :mod:`.s4_refine`: refinement of the addresses (paper Eq. 5).
5. :mod:`.s5_calibrate`: thresholds and temperatures of the gates.
6. :mod:`.s6_targets`: each edit's write target.
7. :mod:`.s7_ridge`: one ridge solve for all writes (paper Eq. 6).
8. :mod:`.s8_finetune`: NLL fine-tuning of the writes.

:mod:`aloe_build.pipeline` runs them in order with checkpoints; the forward passes and state
collection they share live beside this package (``forward``, ``edited_forward``, ``states``,
``slot_sets``, ``token_tree``).
"""
