/// Every line's `custom_id`, in one buffer: a few bytes per line instead of a `String` each.
#[derive(Debug, Default, Clone)]
pub struct CustomIds {
    text: String,
    ends: Vec<u32>,
}

impl CustomIds {
    /// Appends the id of the next line.
    pub fn push(&mut self, id: &str) {
        self.text.push_str(id);
        self.ends.push(self.text.len() as u32);
    }

    /// The id of line `index` (0-based).
    pub fn get(&self, index: usize) -> Option<&str> {
        let end = *self.ends.get(index)? as usize;
        let start = match index {
            0 => 0,
            _ => self.ends[index - 1] as usize,
        };
        Some(&self.text[start..end])
    }

    /// How many lines.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_and_returns_in_order() {
        let mut ids = CustomIds::default();
        for id in ["a", "", "ccc", "ü"] {
            ids.push(id);
        }
        assert_eq!(ids.len(), 4);
        assert_eq!(
            (0..4).map(|i| ids.get(i).unwrap()).collect::<Vec<_>>(),
            ["a", "", "ccc", "ü"]
        );
        assert_eq!(ids.get(4), None);
    }
}
