"""Settings shared by the commands and the layers under them, each declared once: what trains
(``finetune``) and the parallel layout (``parallel``)."""
