-- optim — optimizers and learning-rate schedules.
return {
  AdamW = require("luazero.optim.adamw"),
  schedule = require("luazero.optim.schedule"),
}
