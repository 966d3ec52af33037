package endpoints

import "testing"

func TestValidateIgnoredLabels(t *testing.T) {
	tests := []struct {
		keys []string
		ok   bool
	}{
		{nil, true},
		{IgnoredPodLabels(), true},
		{[]string{"rollout", "example.com/canary"}, true},
		{[]string{""}, false},
		{[]string{"app=web"}, false},
		{[]string{"two words"}, false},
	}
	for _, tc := range tests {
		err := ValidateIgnoredLabels(tc.keys)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateIgnoredLabels(%q) = %v, want ok=%v", tc.keys, err, tc.ok)
		}
	}
}
