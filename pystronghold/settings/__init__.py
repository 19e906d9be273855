"""Settings shared by the commands and the layers under them, each declared once: what trains
(``finetune``), the parallel layout (``parallel``) and the compute precision (``precision``)."""
