"""The family wing: every model family mm-train ships, each a module that registers a FamilySpec
(mm_train.registry). ``video/`` holds the video-generation families and what they share (data,
encoders, samples, tiny sets); ``vl/`` the vision-language ones. Generic mm-train code never imports
from here; the registry finds these modules."""
