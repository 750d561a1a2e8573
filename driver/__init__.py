"""The compile driver and the step around the runtime: everything between the face and the passes.

``harmony.compile`` (the face, harmony/api.py) hands its checked options here. ``driver.compile`` traces the
model, costs it, plans this rank through its parallel mode (driver/modes/: single, data parallel, ZeRO,
pipeline, balance), runs the pass pipeline and assembles the runtime; every other path into planning (a new
batch shape, driver/shapes.py; an evaluation schedule, driver/evaluate.py; a pipeline group or device-step
candidate, driver/modes/pipeline_plan.py and driver/mixed_steps.py) goes through the same driver. The step
itself (driver/step.py), the ranks' handshake (driver/handshake.py) and checkpoints (driver/checkpoint/) live
here too. The layer sits above passes/ and viz/, below the face; it never imports the face.
"""
