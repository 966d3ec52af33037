package textcut

import "testing"

func TestCut(t *testing.T) {
	for _, tc := range []struct {
		in   string
		max  int
		want string
	}{
		{"short", 5, "short"},
		{"", 0, ""},
		{"abcdefgh", 5, "abcde… (3 more bytes)"},
		// "é" is two bytes: a cut inside it moves back to its start.
		{"abcdé", 5, "abcd… (2 more bytes)"},
		{"ééé", 1, "… (6 more bytes)"},
	} {
		if got := Cut(tc.in, tc.max); got != tc.want {
			t.Errorf("Cut(%q, %d) = %q, want %q", tc.in, tc.max, got, tc.want)
		}
	}
}
