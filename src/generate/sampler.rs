//! Token sampling in mlx_lm's order (`mlx_lm/sample_utils.py`, `generate.py`): logits
//! processors (repetition penalty over the last 20 tokens, prompt included) act on logits;
//! logits become log-probabilities; top-p, then min-p, then top-k mask the *untempered*
//! log-probabilities; the token is drawn from `logprobs / temperature`. Temperature 0 is argmax.
//! The random stream is ChaCha8 seeded by the caller, so a seed reproduces a run anywhere.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// Kept when in (0, 1), like mlx_lm.
    pub top_p: f32,
    /// Kept when non-zero.
    pub min_p: f32,
    /// Kept when > 0.
    pub top_k: usize,
    /// mlx_lm's sign-aware multiplicative penalty; `None` or 1.0 for none.
    pub repetition_penalty: Option<f32>,
    pub repetition_context: usize,
}

impl Default for SamplerConfig {
    /// The tuned bot's settings.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.95,
            top_p: 0.9,
            min_p: 0.0,
            top_k: 0,
            repetition_penalty: None,
            repetition_context: 20,
        }
    }
}

impl SamplerConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top-p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p must be in [0, 1], got {}", self.min_p));
        }
        if let Some(p) = self.repetition_penalty {
            if !(p >= 0.0 && p.is_finite()) {
                return Err(format!("repetition penalty must be >= 0, got {p}"));
            }
        }
        Ok(())
    }
}

/// In place: `logits - logsumexp(logits)`.
pub fn log_softmax(logits: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    for x in logits.iter_mut() {
        *x -= lse;
    }
}

/// mlx_lm `make_repetition_penalty`: logits of the last `context` tokens are divided by the
/// penalty when positive, multiplied when negative (each distinct token once).
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32, context: usize) {
    let start = history.len().saturating_sub(context);
    let mut seen: Vec<u32> = history[start..].to_vec();
    seen.sort_unstable();
    seen.dedup();
    for id in seen {
        if let Some(x) = logits.get_mut(id as usize) {
            *x = if *x < 0.0 { *x * penalty } else { *x / penalty };
        }
    }
}

/// Indices sorted by descending log-probability (ties: lower id first).
fn order_desc(logprobs: &[f32]) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        logprobs[b as usize]
            .total_cmp(&logprobs[a as usize])
            .then(a.cmp(&b))
    });
    idx
}

/// mlx_lm `apply_top_p`: keeps a token when the cumulative probability of the tokens no more
/// likely than it (ascending order, itself included) exceeds `1 - top_p`.
pub fn apply_top_p(logprobs: &mut [f32], top_p: f32) {
    let order = order_desc(logprobs);
    let mut cum = 0.0f64;
    // Ascending = the descending order walked backwards.
    let threshold = 1.0 - top_p as f64;
    for &i in order.iter().rev() {
        cum += (logprobs[i as usize] as f64).exp();
        if cum <= threshold {
            logprobs[i as usize] = f32::NEG_INFINITY;
        }
    }
}

/// mlx_lm `apply_min_p` (min_tokens_to_keep = 1): drops tokens below `max + ln(min_p)`.
pub fn apply_min_p(logprobs: &mut [f32], min_p: f32) {
    let max = logprobs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let floor = max + min_p.ln();
    for x in logprobs.iter_mut() {
        if *x < floor {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// mlx_lm `apply_top_k`: keeps the `k` most likely tokens.
pub fn apply_top_k(logprobs: &mut [f32], k: usize) {
    if k == 0 || k >= logprobs.len() {
        return;
    }
    let order = order_desc(logprobs);
    for &i in &order[k..] {
        logprobs[i as usize] = f32::NEG_INFINITY;
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
    scratch: Vec<f32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig, seed: u64) -> Self {
        use rand::SeedableRng;
        Sampler {
            cfg,
            rng: ChaCha8Rng::seed_from_u64(seed),
            scratch: Vec::new(),
        }
    }

    /// Log-probabilities after the processors and masks (for tests and diagnostics).
    pub fn masked_logprobs(&mut self, logits: &[f32], history: &[u32]) -> &[f32] {
        self.scratch.clear();
        self.scratch.extend_from_slice(logits);
        let lp = &mut self.scratch;
        if let Some(p) = self
            .cfg
            .repetition_penalty
            .filter(|&p| p != 0.0 && p != 1.0)
        {
            apply_repetition_penalty(lp, history, p, self.cfg.repetition_context);
        }
        log_softmax(lp);
        if self.cfg.temperature > 0.0 {
            if self.cfg.top_p > 0.0 && self.cfg.top_p < 1.0 {
                apply_top_p(lp, self.cfg.top_p);
            }
            if self.cfg.min_p != 0.0 {
                apply_min_p(lp, self.cfg.min_p);
            }
            if self.cfg.top_k > 0 {
                apply_top_k(lp, self.cfg.top_k);
            }
        }
        &self.scratch
    }

    /// Picks the next token. `history` is every token so far (prompt and generated).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let temperature = self.cfg.temperature;
        self.masked_logprobs(logits, history);
        if temperature == 0.0 {
            return crate::engine::Qwen3::argmax(&self.scratch);
        }
        // Categorical over logprobs / T: softmax with the max subtracted, then inverse CDF.
        let inv_t = 1.0 / temperature;
        let max = self
            .scratch
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0f64;
        for x in self.scratch.iter_mut() {
            let w = if x.is_finite() {
                (((*x - max) * inv_t) as f64).exp()
            } else {
                0.0
            };
            *x = w as f32;
            total += w;
        }
        let mut u = self.rng.random::<f64>() * total;
        let mut last_kept = 0;
        for (i, &w) in self.scratch.iter().enumerate() {
            if w > 0.0 {
                last_kept = i;
                u -= w as f64;
                if u < 0.0 {
                    return i as u32;
                }
            }
        }
        last_kept as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(lp: &[f32]) -> Vec<u32> {
        (0..lp.len() as u32)
            .filter(|&i| lp[i as usize].is_finite())
            .collect()
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let mut lp: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        apply_top_p(&mut lp, 0.7);
        assert_eq!(kept(&lp), vec![0, 1]);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplerConfig::default(), seed);
            (0..40).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn temperature_zero_is_argmax() {
        let mut s = Sampler::new(
            SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            0,
        );
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_is_sign_aware() {
        let mut l = vec![2.0, -2.0, 1.0];
        apply_repetition_penalty(&mut l, &[0, 1, 1], 2.0, 20);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
    }
}
