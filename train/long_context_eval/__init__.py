"""Long-context evaluation inside the POD pipeline: RULER offline (``ruler``), the dev / test protocol
(``protocol``), engine scoring (``scoring``) and the rows of the report and the model card (``report``).

It lives in train/ because the pipeline's eval stage and learning curve use it; eval/ (the leaderboard, the
lm-eval tasks) imports it from here."""
